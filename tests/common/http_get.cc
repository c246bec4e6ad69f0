#include "tests/common/http_get.h"

#include <poll.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>

#include "tests/common/raw_socket.h"

namespace kvbridge::testing {

HttpReply HttpGet(uint16_t port, const std::string& path, const std::string& authorization,
                  int timeout_ms) {
  HttpReply r;
  const int fd = ConnectLoopback(port);
  if (fd < 0) {
    r.error = "cannot connect to 127.0.0.1:" + std::to_string(port);
    return r;
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!authorization.empty()) req += "Authorization: " + authorization + "\r\n";
  req += "\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    r.error = "short write";
    return r;
  }
  std::string raw;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[16384];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) {
      close(fd);
      r.error = "timed out after " + std::to_string(timeout_ms) + " ms";
      return r;
    }
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t header_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos) {
    r.error = "not an HTTP answer: '" + raw.substr(0, 80) + "'";
    return r;
  }
  r.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  const std::string head = raw.substr(0, header_end);
  std::string lower;
  for (char c : head) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const size_t ct = lower.find("\r\ncontent-type:");
  if (ct != std::string::npos) {
    size_t begin = ct + 15;
    while (begin < head.size() && head[begin] == ' ') ++begin;
    r.content_type = head.substr(begin, head.find("\r\n", begin) - begin);
  }
  r.body = raw.substr(header_end + 4);
  return r;
}

uint16_t PortOf(const std::string& host_port) {
  return static_cast<uint16_t>(std::atoi(host_port.c_str() + host_port.rfind(':') + 1));
}

}  // namespace kvbridge::testing

namespace kvbridge::testing {

std::map<std::string, double> ParseSamples(const std::string& exposition) {
  std::map<std::string, double> out;
  size_t pos = 0;
  while (pos < exposition.size()) {
    size_t eol = exposition.find('\n', pos);
    if (eol == std::string::npos) eol = exposition.size();
    const std::string line = exposition.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    const std::string v = line.substr(space + 1);
    out[line.substr(0, space)] = v == "+Inf"   ? HUGE_VAL
                                 : v == "-Inf" ? -HUGE_VAL
                                               : std::strtod(v.c_str(), nullptr);
  }
  return out;
}

}  // namespace kvbridge::testing
