// A blocking HTTP/1.1 GET for tests of the daemons' HTTP endpoint (/metrics, /health): one
// request, `Connection: close`, the whole answer read. No kvbridge dependency.
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge::testing {

struct HttpReply {
  int status = 0;  // 0: no answer (connect failed, closed early, timed out); see error
  std::string content_type;
  std::string body;
  std::string error;
};

// GET http://127.0.0.1:<port><path>, with `authorization` as the Authorization header when
// not empty.
HttpReply HttpGet(uint16_t port, const std::string& path, const std::string& authorization = "",
                  int timeout_ms = 5000);

// The port of "host:port".
uint16_t PortOf(const std::string& host_port);

}  // namespace kvbridge::testing

#include <map>

namespace kvbridge::testing {

// The samples of a Prometheus text exposition, keyed by what precedes the value on its line
// (`name` or `name{label="value",...}`, as the server printed it); comments skipped.
std::map<std::string, double> ParseSamples(const std::string& exposition);

}  // namespace kvbridge::testing
