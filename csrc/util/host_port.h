// "host:port" / "[v6]:port" splitting. Header-only.
#pragma once

#include <string>

namespace kvbridge::util {

// Splits "host:port" or "[v6]:port"; the port must be 1-5 decimal digits. host may be empty
// (":4000" = any address).
inline bool SplitHostPort(const std::string& ep, std::string* host, std::string* port) {
  size_t colon;
  if (!ep.empty() && ep[0] == '[') {
    const size_t close = ep.find(']');
    if (close == std::string::npos || close + 1 >= ep.size() || ep[close + 1] != ':') return false;
    *host = ep.substr(1, close - 1);
    colon = close + 1;
  } else {
    colon = ep.rfind(':');
    if (colon == std::string::npos) return false;
    *host = ep.substr(0, colon);
  }
  *port = ep.substr(colon + 1);
  if (port->empty() || port->size() > 5) return false;
  for (char c : *port) {
    if (c < '0' || c > '9') return false;
  }
  return std::stoul(*port) <= 65535;
}

}  // namespace kvbridge::util
