// civetweb does the HTTP (parsing, connections, worker threads); this file only maps a path
// to a handler and checks the token. civetweb rather than a hand-written server or
// prometheus-cpp: it is maintained, packaged in Debian (libcivetweb-dev; prometheus-cpp is
// not, in Debian 12) and small (docs/operations.md).
#include "obs/http_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "util/logging.h"

namespace kvbridge::obs {

struct HttpServer::Impl {
  std::map<std::string, HttpRoute> routes;
  std::string token;
  std::string address;
  mg_context* ctx = nullptr;
};

namespace {

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

// Compares in time independent of where the strings differ.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

void Send(mg_connection* conn, const HttpResponse& r, bool head_only, bool ask_for_token) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\n%sConnection: close\r\n\r\n",
            r.status, Reason(r.status), r.content_type.c_str(), r.body.size(),
            ask_for_token ? "WWW-Authenticate: Bearer realm=\"kvbridge\"\r\n" : "");
  if (!head_only) mg_write(conn, r.body.data(), r.body.size());
}

int OnRequest(mg_connection* conn) {
  auto* im = static_cast<HttpServer::Impl*>(mg_get_user_data(mg_get_context(conn)));
  const mg_request_info* req = mg_get_request_info(conn);
  const std::string method = req->request_method ? req->request_method : "";
  const std::string path = req->local_uri ? req->local_uri : "";
  const bool head = method == "HEAD";
  auto it = im->routes.find(path);
  HttpResponse r;
  if (it == im->routes.end()) {
    r.status = 404;
    r.body = "no such path: " + path + "\n";
  } else if (method != "GET" && !head) {
    r.status = 405;
    r.body = "only GET and HEAD are served\n";
  } else if (!it->second.is_public && !im->token.empty()) {
    const char* auth = mg_get_header(conn, "Authorization");
    const std::string want = "Bearer " + im->token;
    if (auth == nullptr || !SameSecret(auth, want)) {
      r.status = 401;
      r.body = auth == nullptr ? "this cluster has a token: send 'Authorization: Bearer <token>'\n"
                               : "wrong token in the Authorization header\n";
      Send(conn, r, head, /*ask_for_token=*/true);
      return r.status;
    }
    r = it->second.handler();
  } else {
    r = it->second.handler();
  }
  Send(conn, r, head, false);
  return r.status;
}

int OnLog(const mg_connection*, const char* message) {
  KVB_LOG(DEBUG) << "http: " << message;
  return 1;  // handled: civetweb prints nothing itself
}

}  // namespace

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

// Opens and at once closes a connection to the server's port: wakes civetweb's accept loop,
// which otherwise notices mg_stop only at the end of its 2 s poll. The worker that gets the
// connection reads its end at once.
void Poke(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0) return;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host == "0.0.0.0" ? "127.0.0.1" : host.c_str(), &a.sin_addr) == 1) {
    (void)connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  close(fd);
}

}  // namespace

HttpServer::~HttpServer() {
  if (!impl_ || !impl_->ctx) return;
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    mg_stop(impl_->ctx);
    stopped = true;
  });
  const size_t colon = impl_->address.rfind(':');
  const std::string host = impl_->address.substr(0, colon);
  const int port = std::atoi(impl_->address.c_str() + colon + 1);
  while (!stopped) {
    Poke(host, port);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stopper.join();
}

const std::string& HttpServer::address() const { return impl_->address; }

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen,
                                                      std::map<std::string, HttpRoute> routes,
                                                      std::string bearer_token) {
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : listen.substr(colon + 1);
  char* end = nullptr;
  const long port_number = std::strtol(port.c_str(), &end, 10);
  if (host.empty() || port.empty() || *end != '\0' || port_number < 0 || port_number > 65535) {
    return Status::InvalidArgument("HTTP listen address '" + listen +
                                   "' is not HOST:PORT (an IP address and a port)");
  }
  // civetweb takes IP addresses only.
  if (host == "localhost") host = "127.0.0.1";
  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });

  auto impl = std::make_unique<Impl>();
  impl->routes = std::move(routes);
  impl->token = std::move(bearer_token);
  const std::string ports = host + ":" + port;
  const char* options[] = {
      "listening_ports", ports.c_str(),       "num_threads", "4",    "request_timeout_ms",
      "10000",           "enable_keep_alive", "no",          nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.begin_request = OnRequest;
  callbacks.log_message = OnLog;
  mg_init_data init;
  std::memset(&init, 0, sizeof(init));
  init.callbacks = &callbacks;
  init.user_data = impl.get();
  init.configuration_options = options;
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error;
  std::memset(&error, 0, sizeof(error));
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  impl->ctx = mg_start2(&init, &error);
  if (impl->ctx == nullptr) {
    return Status::Unavailable("cannot serve HTTP on " + listen + ": " +
                               (error_text[0] ? std::string(error_text) + " (" : "(") +
                               "address in use, or not an address of this host)");
  }
  mg_server_port bound;
  std::memset(&bound, 0, sizeof(bound));
  if (mg_get_server_ports(impl->ctx, 1, &bound) < 1) {
    mg_stop(impl->ctx);
    impl->ctx = nullptr;
    return Status::Unavailable("cannot serve HTTP on " + listen + ": no port bound");
  }
  impl->address = host + ":" + std::to_string(bound.port);
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

Result<std::unique_ptr<HttpServer>> StartEndpoint(const std::string& listen, bool best_effort,
                                                  std::map<std::string, HttpRoute> routes,
                                                  std::string bearer_token,
                                                  const std::string& what) {
  if (listen.empty()) return std::unique_ptr<HttpServer>();
  auto server = HttpServer::Start(listen, std::move(routes), std::move(bearer_token));
  if (server.ok()) {
    KVB_LOG(INFO) << what << " serves /metrics and /health on http://" << server.value()->address();
    return server;
  }
  if (!best_effort) return server.status().WithContext(what);
  KVB_LOG(WARN) << what << " runs without its HTTP endpoint (/metrics, /health): "
                << server.status().ToString()
                << "; give another address with --metrics-listen (KVBRIDGE_METRICS_LISTEN)";
  return std::unique_ptr<HttpServer>();
}

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace kvbridge::obs
