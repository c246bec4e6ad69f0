#include "core/handshake.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "util/host_port.h"
#include "util/logging.h"

namespace kvbridge::core {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'B', 'D', 'E', 'S', 'C', '1'};
constexpr uint32_t kMaxDescriptorBytes = 16u << 20;
constexpr int kIoTimeoutMs = 1000;

using Clock = std::chrono::steady_clock;

// Milliseconds left until `deadline` (0 once it has passed).
int LeftMs(Clock::time_point deadline) {
  const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(d.count(), 0));
}

// Waits until fd is ready for `events` or the deadline passes; EINTR waits again.
bool WaitReady(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const int left = LeftMs(deadline);
    if (left == 0) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, left);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// Reads or writes exactly n bytes on a nonblocking socket, all of them by `deadline`: a peer
// that trickles bytes cannot stretch the exchange past it, whichever side it is on.
bool ReadAll(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return false;
    if (errno == EINTR) continue;
    if ((errno != EAGAIN && errno != EWOULDBLOCK) || !WaitReady(fd, POLLIN, deadline)) {
      return false;
    }
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t r = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK) || !WaitReady(fd, POLLOUT, deadline)) {
      return false;
    }
  }
  return true;
}

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

Result<std::unique_ptr<RequestServer>> RequestServer::Start(const std::string& listen,
                                                            const std::string& what,
                                                            Handler handler, Limits limits) {
  std::string host, port;
  if (!util::SplitHostPort(listen, &host, &port)) {
    return Status::InvalidArgument(what + " '" + listen + "' is not host:port");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    return Status::Unavailable(what + " '" + listen + "': " + gai_strerror(gai));
  }
  std::unique_ptr<RequestServer> s(new RequestServer());
  s->handler_ = std::move(handler);
  s->limits_ = limits;
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 256) == 0) {
      s->fd_ = fd;
      break;
    }
    why = ErrnoText();
    close(fd);
  }
  freeaddrinfo(res);
  if (s->fd_ < 0) return Status::Unavailable(what + " " + listen + ": " + why);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(s->fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  const uint16_t bound =
      ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                     : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  const bool v6 = host.find(':') != std::string::npos;
  s->address_ = (v6 ? "[" + host + "]" : host) + ":" + std::to_string(bound);
  if (pipe2(s->wake_, O_CLOEXEC) != 0) return Status::Internal("pipe: " + ErrnoText());
  RequestServer* raw = s.get();
  s->thread_ = std::thread([raw] { raw->Loop(); });
  return s;
}

RequestServer::~RequestServer() {
  if (wake_[1] >= 0) {
    const char c = 0;
    (void)!write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
  for (int f : wake_) {
    if (f >= 0) close(f);
  }
}

namespace {

// One exchange in progress: the request coming in, then the answer going out.
struct Exchange {
  int fd = -1;
  std::string source;  // the client's address, without the port
  Clock::time_point deadline;
  std::string in;   // the request so far
  std::string out;  // the answer, once the handler gave one
  bool answered = false;
  size_t sent = 0;
};

std::string SourceOf(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  } else {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  }
  return buf;
}

// Advances one exchange as far as the socket allows: 1 when the answer went out in full,
// -1 when it failed (refused or oversized request, peer gone), 0 when it must wait.
int Advance(Exchange& x, const RequestServer::Handler& handler, size_t max_request) {
  while (!x.answered) {
    char buf[4096];
    const size_t room = std::min(sizeof(buf), max_request - x.in.size());
    const ssize_t r = recv(x.fd, buf, room, MSG_DONTWAIT);
    if (r == 0) return -1;
    if (r < 0) return errno == EINTR ? 0 : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    x.in.append(buf, static_cast<size_t>(r));
    RequestServer::Answer a = handler(x.in);
    if (a.kind == RequestServer::Answer::kClose) return -1;
    if (a.kind == RequestServer::Answer::kReply) {
      x.out = std::move(a.out);
      x.answered = true;
    } else if (x.in.size() >= max_request) {
      return -1;
    }
  }
  while (x.sent < x.out.size()) {
    const ssize_t r =
        send(x.fd, x.out.data() + x.sent, x.out.size() - x.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      x.sent += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
  }
  return 1;
}

}  // namespace

// Every exchange is multiplexed on this one thread, each with its own time bound, so clients
// that connect and stay silent (or trickle bytes) delay nobody else. Past the open bounds the
// oldest exchange (of that address, or of all) is closed to make room, so a flood from one
// address costs that address its own stalled connections, not everyone the service.
void RequestServer::Loop() {
  std::vector<Exchange> xs;
  auto finish = [&](size_t i, bool ok) {
    close(xs[i].fd);
    ++(ok ? served_ : rejected_);
    xs[i] = std::move(xs.back());
    xs.pop_back();
  };
  auto evict_oldest = [&](const std::string* source) {
    size_t oldest = xs.size();
    for (size_t i = 0; i < xs.size(); ++i) {
      if ((source == nullptr || xs[i].source == *source) &&
          (oldest == xs.size() || xs[i].deadline < xs[oldest].deadline)) {
        oldest = i;
      }
    }
    if (oldest < xs.size()) finish(oldest, false);
  };
  std::vector<pollfd> fds;
  for (;;) {
    auto now = Clock::now();
    for (size_t i = xs.size(); i-- > 0;) {
      if (xs[i].deadline <= now) finish(i, false);
    }
    int timeout = -1;
    for (const Exchange& x : xs) {
      const int left = std::max(1, LeftMs(x.deadline));
      timeout = timeout < 0 ? left : std::min(timeout, left);
    }
    fds.assign({{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}});
    for (const Exchange& x : xs) fds.push_back({x.fd, x.answered ? POLLOUT : POLLIN, 0});
    if (poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    // Exchanges first (their indices match fds[2..] until one finishes), then new ones.
    for (size_t i = xs.size(); i-- > 0;) {
      if (fds[i + 2].revents == 0) continue;
      const int r = Advance(xs[i], handler_, limits_.max_request_bytes);
      if (r != 0) finish(i, r > 0);
    }
    if ((fds[0].revents & POLLIN) == 0) continue;
    for (int accepted = 0; accepted < 64; ++accepted) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      const int c =
          accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (c < 0) {
        // Out of descriptors (EMFILE/ENFILE) leaves the connection queued: don't spin on it.
        if (errno == EMFILE || errno == ENFILE) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        break;
      }
      Exchange x;
      x.fd = c;
      x.source = SourceOf(ss);
      x.deadline = Clock::now() + std::chrono::milliseconds(limits_.exchange_timeout_ms);
      size_t same = 0;
      for (const Exchange& y : xs) same += y.source == x.source ? 1 : 0;
      if (same >= limits_.max_per_source) evict_oldest(&x.source);
      if (xs.size() >= limits_.max_open) evict_oldest(nullptr);
      xs.push_back(std::move(x));
      // The request is often there already.
      const int r = Advance(xs.back(), handler_, limits_.max_request_bytes);
      if (r != 0) finish(xs.size() - 1, r > 0);
    }
  }
  for (const Exchange& x : xs) close(x.fd);
}

Result<std::unique_ptr<RequestServer>> StartHandshakeServer(const std::string& listen,
                                                            std::function<std::string()> describe) {
  auto answer = [describe = std::move(describe)](std::string_view in) {
    RequestServer::Answer a;
    if (in.size() < sizeof(kMagic)) {
      if (std::memcmp(in.data(), kMagic, in.size()) != 0) a.kind = RequestServer::Answer::kClose;
      return a;
    }
    if (in.size() > sizeof(kMagic) || std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
      a.kind = RequestServer::Answer::kClose;
      return a;
    }
    const std::string d = describe();
    const auto n = static_cast<uint32_t>(d.size());
    a.kind = RequestServer::Answer::kReply;
    a.out.assign(kMagic, sizeof(kMagic));
    const char len[4] = {static_cast<char>(n), static_cast<char>(n >> 8),
                         static_cast<char>(n >> 16), static_cast<char>(n >> 24)};
    a.out.append(len, 4);
    a.out += d;
    return a;
  };
  RequestServer::Limits limits;
  limits.max_request_bytes = sizeof(kMagic);
  limits.exchange_timeout_ms = kIoTimeoutMs;
  return RequestServer::Start(listen, "handshake_listen", std::move(answer), limits);
}

Result<std::string> FetchDescriptor(const std::string& host_port, uint32_t timeout_ms) {
  std::string host, port;
  if (!util::SplitHostPort(host_port, &host, &port) || host.empty()) {
    return Status::InvalidArgument("'" + host_port + "' is not host:port");
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    return Status::PeerUnreachable("handshake with " + host_port + ": " + gai_strerror(gai));
  }
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    if (errno == EINPROGRESS) {
      int err = 0;
      socklen_t elen = sizeof(err);
      const bool ready = WaitReady(fd, POLLOUT, deadline);  // EINTR keeps waiting
      if (ready && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) == 0 && err == 0) break;
      why = !ready ? "connect timed out" : std::strerror(err != 0 ? err : errno);
    } else {
      why = ErrnoText();
    }
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) return Status::PeerUnreachable("handshake with " + host_port + ": " + why);
  char magic[sizeof(kMagic)];
  uint8_t len[4];
  std::string out;
  Status st;
  if (!WriteAll(fd, kMagic, sizeof(kMagic), deadline) ||
      !ReadAll(fd, magic, sizeof(magic), deadline) || !ReadAll(fd, len, 4, deadline)) {
    st = LeftMs(deadline) == 0
             ? Status::DeadlineExceeded("handshake with " + host_port + " timed out")
             : Status::PeerUnreachable("handshake with " + host_port + ": connection closed");
  } else if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    st = Status::Protocol(host_port + " is not a kvbridge handshake port");
  } else {
    const uint32_t n = len[0] | (len[1] << 8) | (len[2] << 16) | (uint32_t{len[3]} << 24);
    if (n == 0 || n > kMaxDescriptorBytes) {
      st = Status::Protocol("handshake with " + host_port + ": descriptor of " + std::to_string(n) +
                            " bytes");
    } else {
      out.resize(n);
      if (!ReadAll(fd, out.data(), n, deadline)) {
        st =
            LeftMs(deadline) == 0
                ? Status::DeadlineExceeded("handshake with " + host_port + " timed out")
                : Status::PeerUnreachable("handshake with " + host_port + ": truncated descriptor");
      }
    }
  }
  close(fd);
  if (!st.ok()) return st;
  return out;
}

}  // namespace kvbridge::core
