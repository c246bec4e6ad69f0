#include "store/fast_rpc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <google/protobuf/message_lite.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <random>
#include <system_error>
#include <thread>

#include "store/rpc_util.h"
#include "util/hex.h"
#include "util/little_endian.h"
#include "util/logging.h"

namespace kvbridge::store::fast {
namespace {

constexpr char kServerHello[4] = {'K', 'V', 'B', 'H'};
constexpr char kClientHello[4] = {'K', 'V', 'B', 'A'};
constexpr char kRequest[4] = {'K', 'V', 'B', 'Q'};
constexpr char kReply[4] = {'K', 'V', 'B', 'R'};
constexpr uint16_t kVersion = 1;
constexpr uint16_t kTokenRequired = 1;
constexpr size_t kServerHelloBytes = 4 + 2 + 2 + 16;
constexpr size_t kRequestHeaderBytes = 4 + 2 + 2 + 4;
constexpr size_t kReplyHeaderBytes = 4 + 4 + 4 + 4;
constexpr size_t kMaxProofBytes = 1024;
constexpr size_t kMaxReplyMessageBytes = 64 << 10;
// A peer that stops in the middle of a frame, or a new connection that does not say hello,
// is given this long.
constexpr int kStalledFrameMs = 30000;
constexpr int kConnectMs = 1000;

int64_t MsLeft(Clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
}

// Waits until fd is ready for `events` or the deadline (nullopt: no limit) passes.
bool WaitFor(int fd, short events, std::optional<Clock::time_point> deadline, std::string* why) {
  for (;;) {
    int timeout = -1;
    if (deadline) {
      const int64_t left = MsLeft(*deadline);
      if (left <= 0) {
        *why = "timed out";
        return false;
      }
      timeout = static_cast<int>(std::min<int64_t>(left + 1, 1 << 30));
    }
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, timeout);
    if (r > 0) return true;  // ready, or an error the next read/write reports
    if (r < 0 && errno != EINTR) {
      *why = std::string("poll: ") + std::strerror(errno);
      return false;
    }
  }
}

bool ReadAll(int fd, void* out, size_t n, std::optional<Clock::time_point> deadline,
             std::string* why) {
  auto* buf = static_cast<char*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, buf + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) {
      *why = got == 0 ? "the connection was closed" : "the connection was closed within a frame";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *why = std::string("recv: ") + std::strerror(errno);
      return false;
    }
    if (!WaitFor(fd, POLLIN, deadline, why)) return false;
  }
  return true;
}

bool WriteAll(int fd, iovec* iov, int count, std::optional<Clock::time_point> deadline,
              std::string* why) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        *why = std::string("send: ") + std::strerror(errno);
        return false;
      }
      if (!WaitFor(fd, POLLOUT, deadline, why)) return false;
      continue;
    }
    size_t left = static_cast<size_t>(w);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

void NoDelay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string PeerName(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "?";
}

// A reply frame: header, message, payload.
bool WriteReply(int fd, const grpc::Status& st, std::string_view payload,
                std::optional<Clock::time_point> deadline, std::string* why) {
  const std::string& message = st.error_message();
  const std::string_view body = st.ok() ? payload : std::string_view();
  uint8_t head[kReplyHeaderBytes];
  std::memcpy(head, kReply, 4);
  util::PutLe32(head + 4, static_cast<uint32_t>(st.error_code()));
  util::PutLe32(head + 8, static_cast<uint32_t>(message.size()));
  util::PutLe32(head + 12, static_cast<uint32_t>(body.size()));
  iovec iov[3] = {{head, sizeof(head)},
                  {const_cast<char*>(message.data()), message.size()},
                  {const_cast<char*>(body.data()), body.size()}};
  return WriteAll(fd, iov, 3, deadline, why);
}

// Reads a reply frame: its status, and its payload into *payload.
bool ReadReply(int fd, Clock::time_point deadline, grpc::Status* st, std::string* payload,
               std::string* why) {
  uint8_t head[kReplyHeaderBytes];
  if (!ReadAll(fd, head, sizeof(head), deadline, why)) return false;
  if (std::memcmp(head, kReply, 4) != 0) {
    *why = "the answer is not a reply frame";
    return false;
  }
  const auto code = static_cast<int32_t>(util::GetLe32(head + 4));
  const uint32_t message_len = util::GetLe32(head + 8);
  const uint32_t payload_len = util::GetLe32(head + 12);
  if (message_len > kMaxReplyMessageBytes || payload_len > uint32_t{kMaxMessageBytes} || code < 0 ||
      code > grpc::StatusCode::UNAUTHENTICATED) {
    *why = "the reply frame's header is out of range";
    return false;
  }
  std::string message(message_len, '\0');
  if (!ReadAll(fd, message.data(), message_len, deadline, why)) return false;
  payload->resize(payload_len);
  if (!ReadAll(fd, payload->data(), payload_len, deadline, why)) return false;
  *st = grpc::Status(static_cast<grpc::StatusCode>(code), message);
  return true;
}

}  // namespace

std::string ConnectMethod(const std::array<uint8_t, 16>& nonce) {
  return "/kvbridge.fast/Connect/" +
         util::HexEncode(
             std::string_view(reinterpret_cast<const char*>(nonce.data()), nonce.size()));
}

// --- Server ---

Server::Server(RpcAuth* auth, std::string who, Handler handler)
    : auth_(auth), who_(std::move(who)), handler_(std::move(handler)) {}

Result<std::unique_ptr<Server>> Server::Start(const std::string& host, uint16_t port, RpcAuth* auth,
                                              std::string who, Handler handler) {
  std::unique_ptr<Server> s(new Server(auth, std::move(who), std::move(handler)));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int gai =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (gai != 0) {
    return Status::InvalidArgument("the lean port's host '" + host + "': " + ::gai_strerror(gai));
  }
  std::string why = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 512) != 0) {
      why = std::string("bind/listen: ") + std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    s->port_ =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    s->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(res);
  if (s->listen_fd_ < 0) {
    return Status::Unavailable("cannot listen on " + host + ":" + service +
                               " (the lean port): " + why);
  }
  s->acceptor_ = std::thread([raw = s.get()] { raw->AcceptLoop(); });
  return s;
}

Server::~Server() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
    // Wakes accept() and every connection's read; their threads close the sockets.
    if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return threads_ == 0; });
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

size_t Server::connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

void Server::AcceptLoop() {
  for (;;) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the clients fall back to gRPC meanwhile.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      KVB_LOG(ERROR) << "the " << who_ << "'s lean port stops accepting: " << std::strerror(errno);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || open_.size() >= kMaxConnections) {
      ::close(fd);
      continue;
    }
    open_.insert(fd);
    ++threads_;
    try {
      std::thread([this, fd, name = PeerName(peer)] { Serve(fd, name); }).detach();
    } catch (const std::system_error& e) {
      // No thread to be had (a process or memory limit): this connection is closed, its
      // client uses gRPC, and the port goes on accepting.
      open_.erase(fd);
      --threads_;
      ::close(fd);
      refused_.fetch_add(1);
      KVB_LOG(WARN) << "the " << who_ << "'s lean port closed a connection: no thread for it ("
                    << e.what() << ")";
    }
  }
}

void Server::Refuse(const std::string& peer, const std::string& why) {
  refused_.fetch_add(1);
  // At most one line a second: a scan of the port must not flood the log.
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t last = last_warn_ms_.load();
  if (now - last < 1000 || !last_warn_ms_.compare_exchange_strong(last, now)) return;
  KVB_LOG(WARN) << "the " << who_ << "'s lean port closed the connection from " << peer << ": "
                << why;
}

void Server::Serve(int fd, std::string peer) {
  NoDelay(fd);
  const auto stalled = [] { return Clock::now() + std::chrono::milliseconds(kStalledFrameMs); };
  std::string why;
  std::string request, reply;
  // Hello: the nonce this connection's proof must be bound to.
  AuthNonce nonce{};
  {
    std::random_device rd;
    for (auto& b : nonce) b = static_cast<uint8_t>(rd());
  }
  uint8_t hello[kServerHelloBytes];
  std::memcpy(hello, kServerHello, 4);
  util::PutLe16(hello + 4, kVersion);
  util::PutLe16(hello + 6, auth_->enabled() ? kTokenRequired : 0);
  std::memcpy(hello + 8, nonce.data(), nonce.size());
  iovec hiov[1] = {{hello, sizeof(hello)}};
  bool ok = WriteAll(fd, hiov, 1, stalled(), &why);
  if (ok) {
    uint8_t head[8];
    ok = ReadAll(fd, head, sizeof(head), stalled(), &why);
    const uint16_t proof_len = ok ? util::GetLe16(head + 6) : 0;
    if (ok && (std::memcmp(head, kClientHello, 4) != 0 || proof_len > kMaxProofBytes)) {
      ok = false;
      why = "its hello is not a kvbridge client's";
    }
    std::string proof(proof_len, '\0');
    if (ok) ok = ReadAll(fd, proof.data(), proof.size(), stalled(), &why);
    if (ok) {
      // A refused proof is logged by CheckProof, and answered before the connection closes.
      const grpc::Status st =
          auth_->CheckProof(proof, !proof.empty(), ConnectMethod(nonce), peer, who_);
      ok = WriteReply(fd, st, {}, stalled(), &why) && st.ok();
      if (!st.ok()) {
        refused_.fetch_add(1);
        why.clear();
      }
    }
  }
  while (ok) {
    uint8_t head[kRequestHeaderBytes];
    // Between calls a connection may stay idle as long as its client keeps it; a frame once
    // begun must come whole.
    if (!WaitFor(fd, POLLIN, std::nullopt, &why) ||
        !ReadAll(fd, head, sizeof(head), stalled(), &why)) {
      if (why == "the connection was closed") why.clear();  // the client is done with it
      break;
    }
    const uint16_t method = util::GetLe16(head + 4);
    const uint32_t len = util::GetLe32(head + 8);
    if (std::memcmp(head, kRequest, 4) != 0) {
      why = "a frame that is not a request";
      break;
    }
    if (len > uint32_t{kMaxMessageBytes}) {
      why = "a request of " + std::to_string(len) + " bytes, over the " +
            std::to_string(kMaxMessageBytes) + "-byte limit";
      break;
    }
    request.resize(len);
    if (!ReadAll(fd, request.data(), len, stalled(), &why)) break;
    reply.clear();
    grpc::Status st;
    if (method < static_cast<uint16_t>(Method::kPutStart) ||
        method > static_cast<uint16_t>(Method::kExists)) {
      st = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "the " + who_ + "'s lean port has no method " + std::to_string(method));
    } else {
      st = handler_(static_cast<Method>(method), request, &reply);
      calls_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!WriteReply(fd, st, reply, stalled(), &why)) break;
  }
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping = stopping_;
  }
  if (!why.empty() && !stopping) Refuse(peer, why);
  std::lock_guard<std::mutex> lock(mu_);
  open_.erase(fd);
  ::close(fd);
  if (--threads_ == 0) idle_cv_.notify_all();
}

// --- Client ---

Connection::~Connection() {
  if (fd_ >= 0) ::close(fd_);
}

Client::Client(std::string host, uint16_t port, const RpcAuth& auth)
    : host_(std::move(host)),
      port_(port),
      address_((host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_) + ":" +
               std::to_string(port)),
      auth_(auth),
      pid_(::getpid()) {}

Client::~Client() = default;

std::unique_ptr<Connection> Client::Connect(Clock::time_point deadline, grpc::Status* error,
                                            bool* fallback) {
  *fallback = true;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res) != 0)
    return nullptr;
  std::unique_ptr<Connection> conn;
  std::string why;
  for (addrinfo* ai = res; ai != nullptr && !conn; ai = ai->ai_next) {
    const int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    auto c = std::make_unique<Connection>(fd);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      // A port that drops the connection attempt (a firewall) costs a call this long at most
      // before it goes over gRPC.
      const auto connect_by =
          std::min(deadline, Clock::now() + std::chrono::milliseconds(kConnectMs));
      if (errno != EINPROGRESS || !WaitFor(fd, POLLOUT, connect_by, &why)) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) continue;
    }
    conn = std::move(c);
  }
  ::freeaddrinfo(res);
  if (!conn) return nullptr;  // refused or unreachable: gRPC says why
  NoDelay(conn->fd());
  // The server's hello, then ours with the proof bound to its nonce, then its answer.
  uint8_t hello[kServerHelloBytes];
  if (!ReadAll(conn->fd(), hello, sizeof(hello), deadline, &why) ||
      std::memcmp(hello, kServerHello, 4) != 0) {
    if (why == "timed out") {  // a frozen master: gRPC would wait the same
      *fallback = false;
      *error = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "the master's lean port at " + address_ + " did not say hello in time");
    }
    return nullptr;
  }
  AuthNonce nonce{};
  std::memcpy(nonce.data(), hello + 8, nonce.size());
  const std::string proof = auth_.Proof(ConnectMethod(nonce));
  uint8_t head[8];
  std::memcpy(head, kClientHello, 4);
  util::PutLe16(head + 4, kVersion);
  util::PutLe16(head + 6, static_cast<uint16_t>(proof.size()));
  iovec iov[2] = {{head, sizeof(head)}, {const_cast<char*>(proof.data()), proof.size()}};
  grpc::Status answer;
  std::string unused;
  if (!WriteAll(conn->fd(), iov, 2, deadline, &why) ||
      !ReadReply(conn->fd(), deadline, &answer, &unused, &why)) {
    if (why == "timed out") {
      *fallback = false;
      *error = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "the master's lean port at " + address_ + " did not answer in time");
    }
    return nullptr;
  }
  if (!answer.ok()) {  // the proof refused: gRPC would be refused the same way
    *fallback = false;
    *error = answer;
    return nullptr;
  }
  return conn;
}

std::unique_ptr<Connection> Client::TakeIdle() {
  for (;;) {
    std::unique_ptr<Connection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pid_ != ::getpid()) {
        // A forked child: the pooled sockets are its parent's too, whose answers it could
        // read. It drops its copies and connects on its own.
        idle_.clear();
        pid_ = ::getpid();
      }
      if (idle_.empty()) return nullptr;
      conn = std::move(idle_.back());
      idle_.pop_back();
    }
    // An idle connection has nothing to read: anything there (the master closed it, or it
    // restarted) makes it useless.
    pollfd p{conn->fd(), POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) == 0) return conn;
  }
}

void Client::PutIdle(std::unique_ptr<Connection> conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.size() < kMaxIdle) idle_.push_back(std::move(conn));
}

std::unique_ptr<Connection> Client::Send(Method method,
                                         const google::protobuf::MessageLite& request,
                                         Clock::time_point deadline, grpc::Status* error,
                                         bool* fallback) {
  *fallback = true;
  std::string payload;
  if (!request.SerializeToString(&payload)) {
    *fallback = false;
    *error = grpc::Status(grpc::StatusCode::INTERNAL, "the request does not serialize");
    return nullptr;
  }
  uint8_t head[kRequestHeaderBytes];
  std::memcpy(head, kRequest, 4);
  util::PutLe16(head + 4, static_cast<uint16_t>(method));
  util::PutLe16(head + 6, 0);
  util::PutLe32(head + 8, static_cast<uint32_t>(payload.size()));
  // A pooled connection first; if its send fails, nothing of the request reached the master
  // whole (it reads whole frames only), so a new connection is tried, then gRPC.
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::unique_ptr<Connection> conn = attempt == 0 ? TakeIdle() : nullptr;
    if (!conn) {
      conn = Connect(deadline, error, fallback);
      if (!conn) return nullptr;
      attempt = 1;
    }
    iovec iov[2] = {{head, sizeof(head)}, {payload.data(), payload.size()}};
    std::string why;
    if (WriteAll(conn->fd(), iov, 2, deadline, &why)) return conn;
    if (why == "timed out") {
      *fallback = false;
      *error = grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          "the request to the master's lean port at " + address_ + " could not be sent in time");
      return nullptr;
    }
  }
  return nullptr;
}

grpc::Status Client::Receive(std::unique_ptr<Connection> conn, google::protobuf::MessageLite* reply,
                             Clock::time_point deadline) {
  grpc::Status st;
  std::string payload, why;
  if (!ReadReply(conn->fd(), deadline, &st, &payload, &why)) {
    if (why == "timed out") {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "the master's lean port at " + address_ + " did not answer in time");
    }
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the master's lean port at " + address_ + ": " + why);
  }
  if (st.ok() && !reply->ParseFromString(payload)) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        "the reply from the master's lean port at " + address_ + " does not parse");
  }
  PutIdle(std::move(conn));
  return st;
}

bool Client::Call(Method method, const google::protobuf::MessageLite& request,
                  google::protobuf::MessageLite* reply, Clock::time_point deadline,
                  grpc::Status* status) {
  bool fallback = false;
  grpc::Status error;
  std::unique_ptr<Connection> conn = Send(method, request, deadline, &error, &fallback);
  if (!conn) {
    if (fallback) return false;
    *status = error;
    return true;
  }
  *status = Receive(std::move(conn), reply, deadline);
  return true;
}

}  // namespace kvbridge::store::fast
