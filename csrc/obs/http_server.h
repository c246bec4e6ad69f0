// The daemons' HTTP endpoint (/metrics, /health, the master's status page) on civetweb: a few
// GET routes whose handlers build the whole answer in memory. Meant for scrapers and operators,
// not for data: a handful of worker threads, no keep-alive tuning, no TLS.
//
// Access: with a token set, every route not marked public answers 401 unless the request
// carries `Authorization: Bearer <token>` (docs/operations.md "Token handling").
//
// Thread-safety: handlers run on the server's worker threads, several at once; Start and the
// destructor must not race with each other.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::obs {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

struct HttpRoute {
  std::function<HttpResponse()> handler;
  // Served without the token (what it says must not need one: /health says ok or why not).
  bool is_public = false;
};

class HttpServer {
 public:
  // Listens on `listen` ("HOST:PORT"; port 0 picks one) and serves `routes` by exact path;
  // other paths are 404. UNAVAILABLE naming the address when it cannot be bound (in use, not
  // an address of this host); INVALID_ARGUMENT when it is not HOST:PORT.
  static Result<std::unique_ptr<HttpServer>> Start(const std::string& listen,
                                                   std::map<std::string, HttpRoute> routes,
                                                   std::string bearer_token);
  // Stops accepting, waits for the handlers running.
  ~HttpServer();
  // "host:port" with the port actually bound.
  const std::string& address() const;

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A daemon's endpoint: Start, except that with `best_effort` an address that cannot be bound
// is logged as a warning naming `what` and the address, and null is returned (the daemon runs
// without it). An empty `listen`: null, nothing started.
Result<std::unique_ptr<HttpServer>> StartEndpoint(const std::string& listen, bool best_effort,
                                                  std::map<std::string, HttpRoute> routes,
                                                  std::string bearer_token,
                                                  const std::string& what);

// `s` as a JSON string literal, quotes included.
std::string JsonString(std::string_view s);

}  // namespace kvbridge::obs
