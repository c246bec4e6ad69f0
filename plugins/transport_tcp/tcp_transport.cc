#include "tcp_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <type_traits>

#include "tcp_wire.h"
#include "util/host_port.h"

namespace kvbridge::tcp {

// ---------------------------------------------------------------------------------------------
// Internal types.

struct OpState {
  uint16_t opcode = 0;
  uint64_t length = 0;
  uint32_t total_slices = 0;
  uint32_t ended_slices = 0;
  kvb_status_t error = KVB_OK;            // the first slice error, kept as the op's result
  kvb_status_t status = KVB_IN_PROGRESS;  // what poll reports: final once every slice ended
  std::string msg;
};

// One posted request. Final once every slice has ended, or at once on cancel; after that no
// thread enters its local memory (in_user_mem counts threads inside it right now).
struct Request {
  std::mutex mu;
  std::condition_variable cv;
  Peer* peer = nullptr;  // valid while !final: RemovePeer finalizes before freeing the peer
  std::vector<OpState> ops;
  uint64_t outstanding_slices = 0;
  uint64_t charged_bytes = 0;  // counted in the peer's queued bytes until final
  uint64_t charged_slices = 0;  // counted in the peer's queued slices until final
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  bool final = false;
  uint32_t in_user_mem = 0;
};

// A piece of one op, at most slice_bytes long; the unit that lanes send.
struct Slice {
  std::shared_ptr<Request> req;
  uint32_t op = 0;
  uint16_t opcode = 0;
  uint8_t* local = nullptr;
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  uint64_t posted_ns = 0;
  bool ended = false;  // under req->mu
};

struct Peer {
  std::string node_id;
  uint64_t incarnation = 0;
  std::mutex mu;
  std::condition_variable cv;  // signalled when a lane leaves `lanes`
  std::vector<std::string> endpoints;
  size_t preferred = 0;  // the endpoint that last worked
  std::unordered_map<uint64_t, uint64_t> segment_lengths;
  std::deque<std::unique_ptr<Slice>> queue;
  std::vector<std::unique_ptr<Lane>> lanes;  // connecting or established; <= lanes_per_peer
  uint32_t connecting = 0;
  uint64_t no_connect_before_ns = 0;
  bool removing = false;
  std::vector<std::shared_ptr<Request>> live;  // may hold final ones until pruned
  size_t prune_live_at = 64;
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> queued_slices{0};  // of requests posted and not yet final
  LogLimiter connect_log;
};

namespace {

constexpr uint64_t kMsNs = 1000000;
constexpr size_t kScratchBytes = 64 * 1024;
constexpr int kMaxIov = 64;

std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

std::string ErrnoText(int e) {
  char buf[128];
  return strerror_r(e, buf, sizeof(buf));
}

unsigned long long U(uint64_t v) { return static_cast<unsigned long long>(v); }

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = Trim(std::string_view(s).substr(start, comma - start));
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

using util::SplitHostPort;  // "host:port" or "[v6]:port" (util/host_port.h)

std::string AddrText(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return Fmt("%s:%u", host, port);
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return Fmt("[%s]:%u", host, port);
  }
  return "?";
}

// The IP address of a peer, without the port: what per-source limits count.
std::string SourceText(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, host, sizeof(host));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, host, sizeof(host));
  }
  return host;
}

void SetSocketOptions(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer that vanishes without a FIN (host down, partition) is found by keepalive.
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle_s = 30, interval_s = 5, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

enum class Io { kOk, kTimeout, kClosed, kError, kWoken };

const char* IoText(Io io) {
  switch (io) {
    case Io::kOk:
      return "ok";
    case Io::kTimeout:
      return "timed out";
    case Io::kClosed:
      return "connection closed by peer";
    case Io::kError:
      return "socket error";
    case Io::kWoken:
      return "stopped";
  }
  return "?";
}

// Bounds for a blocking-style exchange on a nonblocking socket: an absolute deadline, a
// progress timeout (restarted by every byte) and an eventfd that aborts the wait.
struct Limits {
  uint64_t deadline_ns = 0;
  uint64_t progress_ns = 0;
  int wake_fd = -1;
};

// Milliseconds poll may wait, or -1 when the limits have passed.
int WaitBudgetMs(const Transport& t, const Limits& lim, uint64_t last_progress_ns) {
  const uint64_t now = t.Now();
  uint64_t left = UINT64_MAX;
  if (lim.deadline_ns != 0) {
    if (now >= lim.deadline_ns) return -1;
    left = lim.deadline_ns - now;
  }
  if (lim.progress_ns != 0) {
    const uint64_t end = last_progress_ns + lim.progress_ns;
    if (now >= end) return -1;
    left = std::min(left, end - now);
  }
  if (left == UINT64_MAX) return 1000;
  return static_cast<int>(std::min<uint64_t>((left + kMsNs - 1) / kMsNs, 1000));
}

Io WaitFd(int fd, short events, int timeout_ms, int wake_fd, int* err) {
  pollfd p[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
  const int n = poll(p, wake_fd >= 0 ? 2 : 1, timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return Io::kOk;
    *err = errno;
    return Io::kError;
  }
  if (n == 0) return Io::kTimeout;
  if (wake_fd >= 0 && (p[1].revents & POLLIN)) return Io::kWoken;
  return Io::kOk;  // ready, or an error condition the next socket call reports
}

// `before_wait`, when given, runs each time the socket has no more bytes and the call is about
// to wait for them; a failure it returns ends the call.
Io RecvAll(const Transport& t, int fd, void* buf, size_t len, const Limits& lim, int* err,
           const std::function<Io()>& before_wait = nullptr) {
  auto* p = static_cast<uint8_t*>(buf);
  size_t got = 0;
  uint64_t last = t.Now();
  while (got < len) {
    const ssize_t r = recv(fd, p + got, len - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      last = t.Now();
      continue;
    }
    if (r == 0) return Io::kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *err = errno;
      return Io::kError;
    }
    if (before_wait) {
      if (const Io io = before_wait(); io != Io::kOk) return io;
    }
    const int ms = WaitBudgetMs(t, lim, last);
    if (ms < 0) return Io::kTimeout;
    const Io w = WaitFd(fd, POLLIN, ms, lim.wake_fd, err);
    if (w == Io::kError || w == Io::kWoken) return w;
  }
  return Io::kOk;
}

// Sends every byte the iovecs describe (the array is consumed).
Io SendAllV(const Transport& t, int fd, iovec* iov, int count, const Limits& lim, int* err) {
  uint64_t last = t.Now();
  while (count > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(count);
    const ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w >= 0) {
      size_t left = static_cast<size_t>(w);
      if (w > 0) last = t.Now();
      while (count > 0 && left >= iov->iov_len) {
        left -= iov->iov_len;
        ++iov;
        --count;
      }
      if (count > 0) {
        iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
        iov->iov_len -= left;
      }
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *err = errno;
      return errno == EPIPE || errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
    const int ms = WaitBudgetMs(t, lim, last);
    if (ms < 0) return Io::kTimeout;
    const Io r = WaitFd(fd, POLLOUT, ms, lim.wake_fd, err);
    if (r == Io::kError || r == Io::kWoken) return r;
  }
  return Io::kOk;
}

Io SendAll(const Transport& t, int fd, const void* data, size_t len, const Limits& lim, int* err) {
  iovec iov{const_cast<void*>(data), len};
  return SendAllV(t, fd, &iov, 1, lim, err);
}

struct HandshakeResult {
  kvb_status_t code = KVB_OK;
  std::string why;      // the host's reason when code is an error
  Io io = Io::kOk;      // not kOk: the socket failed (code is PEER_UNREACHABLE)
  int err = 0;          // errno behind io
};

// Runs the host's peer handshake (ABI 1.2 auth services) on a connected socket: the host makes
// and judges the messages, this only carries them. A client steps first with no input.
HandshakeResult RunHandshake(const Transport& t, int fd, int32_t role,
                             const std::string& expect_node, uint64_t expect_incarnation,
                             const Limits& lim) {
  const kvb_host_services_t* h = t.host();
  char why[512] = {0};
  kvb_auth_t* a = nullptr;
  kvb_status_t st =
      h->auth_begin(h->host_ctx, "tcp", role,
                    role == KVB_AUTH_CLIENT ? expect_node.c_str() : nullptr, expect_incarnation,
                    &a, why, sizeof(why));
  if (st != KVB_OK) return {st, why};
  struct End {
    const kvb_host_services_t* h;
    void operator()(kvb_auth_t* a) const { h->auth_end(h->host_ctx, a); }
  };
  std::unique_ptr<kvb_auth_t, End> session(a, End{h});
  uint8_t in[KVB_AUTH_MAX_MESSAGE], out[KVB_AUTH_MAX_MESSAGE];
  bool receive = role != KVB_AUTH_CLIENT;
  while (true) {
    uint32_t have = 0;
    if (receive) {
      int32_t need = h->auth_need(h->host_ctx, a, in, 0);
      while (need > static_cast<int32_t>(have)) {
        int err = 0;
        const Io io = RecvAll(t, fd, in + have, static_cast<size_t>(need) - have, lim, &err);
        if (io != Io::kOk) return {KVB_ERR_PEER_UNREACHABLE, "", io, err};
        have = static_cast<uint32_t>(need);
        need = h->auth_need(h->host_ctx, a, in, have);
      }
      if (need < 0) return {KVB_ERR_PROTOCOL, "malformed handshake message"};
    }
    uint32_t out_len = 0;
    st = h->auth_step(h->host_ctx, a, receive ? in : nullptr, have, out, sizeof(out), &out_len,
                      why, sizeof(why));
    receive = true;
    if (out_len > 0) {
      int err = 0;
      const Io io = SendAll(t, fd, out, out_len, lim, &err);
      // A refusal is sent as a courtesy; its failure changes nothing.
      if (io != Io::kOk && (st == KVB_OK || st == KVB_IN_PROGRESS)) {
        return {KVB_ERR_PEER_UNREACHABLE, "", io, err};
      }
    }
    if (st != KVB_IN_PROGRESS) return {st, st == KVB_OK ? "" : why};
  }
}

std::string IoError(Io io, int err) {
  if (io == Io::kError) return ErrnoText(err);
  return IoText(io);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config, log limiter, token bucket.

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err) {
  auto read = [&](const char* key, uint64_t min, uint64_t max, auto* field) -> bool {
    char buf[64];
    const int32_t n = host->config_get(host->host_ctx, key, buf, sizeof(buf));
    if (n == -1) return true;
    if (n < 0) {
      *err = Fmt("%s: value is too long", key);
      return false;
    }
    const std::string v = Trim(std::string_view(buf, static_cast<size_t>(n)));
    uint64_t value = 0;
    bool ok = !v.empty() && v.size() <= 19;
    for (char c : v) ok = ok && c >= '0' && c <= '9';
    if (ok) value = std::stoull(v);
    if (!ok) {
      *err = Fmt("%s: '%s' is not an unsigned integer", key, buf);
      return false;
    }
    if (value < min || value > max) {
      *err = Fmt("%s: %llu is outside [%llu, %llu]", key, U(value), U(min), U(max));
      return false;
    }
    *field = static_cast<std::remove_reference_t<decltype(*field)>>(value);
    return true;
  };
  Config c;
  const bool ok =
      read("tcp.lanes_per_peer", 1, 256, &c.lanes_per_peer) &&
      read("tcp.slice_bytes", 1, 1ull << 30, &c.slice_bytes) &&
      read("tcp.max_queued_bytes_per_peer", 1, 1ull << 62, &c.max_queued_bytes_per_peer) &&
      read("tcp.max_queued_slices_per_peer", 1, 1ull << 40, &c.max_queued_slices_per_peer) &&
      read("tcp.window_slices", 1, 1024, &c.window_slices) &&
      read("tcp.connect_timeout_ms", 1, 600000, &c.connect_timeout_ms) &&
      read("tcp.progress_timeout_ms", 1, 3600000, &c.progress_timeout_ms) &&
      read("tcp.idle_timeout_ms", 1, 86400000, &c.idle_timeout_ms) &&
      read("tcp.idle_close_per_sec", 1, 1000000, &c.idle_close_per_sec) &&
      read("tcp.max_inbound", 1, 1000000, &c.max_inbound) &&
      read("tcp.max_inbound_per_source", 1, 1000000, &c.max_inbound_per_source) &&
      read("tcp.min_inbound_bytes_per_sec", 1, 1ull << 40, &c.min_inbound_bytes_per_sec) &&
      read("tcp.inbound_idle_timeout_ms", 1, 86400000, &c.inbound_idle_timeout_ms) &&
      read("tcp.max_frame_bytes", 1, 1ull << 32, &c.max_frame_bytes);
  if (!ok) return false;
  if (c.slice_bytes > c.max_frame_bytes) {
    *err = Fmt("tcp.slice_bytes: %llu exceeds tcp.max_frame_bytes (%llu)", U(c.slice_bytes),
               U(c.max_frame_bytes));
    return false;
  }
  *out = c;
  return true;
}

bool LogLimiter::Allow(uint64_t now_ns, uint64_t* suppressed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (now_ns < next_ns_) {
    ++suppressed_;
    return false;
  }
  *suppressed = suppressed_;
  suppressed_ = 0;
  next_ns_ = now_ns + 1000 * kMsNs;
  return true;
}

bool TokenBucket::TryTake(uint64_t now_ns, uint64_t* next_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!primed_) {
    primed_ = true;
    last_ns_ = now_ns;
  }
  if (now_ns > last_ns_) {
    tokens_ = std::min(1.0, tokens_ + static_cast<double>(now_ns - last_ns_) * per_sec_ / 1e9);
    last_ns_ = now_ns;
  }
  if (tokens_ >= 1.0) {
    tokens_ -= 1.0;
    return true;
  }
  *next_ns = now_ns + static_cast<uint64_t>((1.0 - tokens_) * 1e9 / per_sec_) + 1;
  return false;
}

// ---------------------------------------------------------------------------------------------
// Lane: one outbound connection to one peer incarnation, driven by one thread.

class Lane {
 public:
  Lane(Transport* t, Peer* peer, int wake_fd) : t_(t), peer_(peer), wake_fd_(wake_fd) {}
  ~Lane() {
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  void Run();
  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  void Stop() {
    stop_.store(true);
    Wake();
  }

  std::thread thread;
  bool established = false;  // under peer->mu
  std::atomic<uint32_t> inflight_count{0};

 private:
  enum class Exit { kIdle, kStop, kFail, kRequeue };
  struct Outcome {
    Exit exit = Exit::kFail;
    kvb_status_t code = KVB_OK;
    std::string msg;
  };
  struct Entry {
    std::unique_ptr<Slice> s;
    uint64_t id = 0;
    uint8_t hdr[wire::kRequestHeaderBytes];
    uint64_t sent = 0;       // frame bytes (header + WRITE payload) already sent
    bool abandoned = false;  // ended or request final: its local memory is off limits
    uint64_t frame_bytes() const {
      return wire::kRequestHeaderBytes + (s->opcode == KVB_OP_WRITE ? s->length : 0);
    }
  };

  bool Connect(kvb_status_t* code, std::string* msg);
  int Dial(const std::string& ep, uint64_t deadline_ns, std::string* why);
  kvb_status_t Handshake(int fd, const std::string& ep, uint64_t deadline_ns, std::string* why);
  void OnConnectFailed(kvb_status_t code, const std::string& msg);
  Outcome Serve();
  bool SendSome(uint64_t now, Outcome* out);
  bool RecvSome(uint64_t now, Outcome* out, Completions* done);
  void CompleteFront(kvb_status_t code, const std::string& msg, Completions* done);
  void Teardown(const Outcome& o);
  uint64_t ProgressTimeoutNs() const;
  std::string Name() const {
    return Fmt("'%s' incarnation %#llx at %s", peer_->node_id.c_str(), U(peer_->incarnation),
               endpoint_.c_str());
  }

  static bool Live(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    return !s.ended && !s.req->final;
  }
  static bool Wanted(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    return !s.ended && !s.req->final && s.req->ops[s.op].error == KVB_OK;
  }
  static bool EnterUserMem(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    if (s.ended || s.req->final) return false;
    ++s.req->in_user_mem;
    return true;
  }
  static void ExitUserMem(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    if (--s.req->in_user_mem == 0) s.req->cv.notify_all();
  }

  Transport* const t_;
  Peer* const peer_;
  const int wake_fd_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::string endpoint_;
  std::deque<Entry> inflight_;  // send order == response order
  size_t send_idx_ = 0;         // first entry not completely sent
  uint8_t rhdr_[wire::kResponseHeaderBytes];
  size_t rhdr_got_ = 0;
  bool in_payload_ = false;  // receiving the front entry's READ payload
  uint64_t payload_got_ = 0;
  uint64_t next_id_ = 1;
  uint64_t last_progress_ns_ = 0;
  uint64_t idle_since_ns_ = 0;
  std::unique_ptr<uint8_t[]> scratch_;
};

void Lane::Run() {
  Outcome o;
  bool connected = false;
  try {
    scratch_ = std::make_unique<uint8_t[]>(kScratchBytes);
    kvb_status_t code = KVB_OK;
    std::string msg;
    if (!Connect(&code, &msg)) {
      OnConnectFailed(code, msg);
      return;
    }
    connected = true;
    {
      std::lock_guard<std::mutex> lock(peer_->mu);
      --peer_->connecting;
      established = true;
      t_->counters().connections_open.fetch_add(1);
      t_->counters().connections_opened.fetch_add(1);
      t_->MaybeSpawnLanes(*peer_);
    }
    o = Serve();
  } catch (const std::exception& e) {
    if (!connected) {
      if (fd_ >= 0) close(fd_);
      fd_ = -1;
      OnConnectFailed(KVB_ERR_INTERNAL, Fmt("internal error opening a lane: %s", e.what()));
      return;
    }
    o = {Exit::kFail, KVB_ERR_INTERNAL, Fmt("internal error on lane: %s", e.what())};
  }
  switch (o.exit) {
    case Exit::kFail:
      // A lane that carried no work when it broke (typically a peer shutting down) costs
      // nobody anything: worth a note, not a warning.
      t_->Log(inflight_.empty() ? KVB_LOG_INFO : KVB_LOG_WARN, "evicting lane to %s: %s",
              Name().c_str(), o.msg.c_str());
      break;
    case Exit::kRequeue:
      t_->Log(KVB_LOG_INFO, "evicting lane to %s: %s; its other slices are re-queued",
              Name().c_str(), o.msg.c_str());
      break;
    case Exit::kIdle:
      t_->Log(KVB_LOG_DEBUG, "closing idle lane to %s", Name().c_str());
      break;
    case Exit::kStop:
      break;
  }
  Teardown(o);
}

int Lane::Dial(const std::string& ep, uint64_t deadline_ns, std::string* why) {
  std::string host, port;
  if (!SplitHostPort(ep, &host, &port)) {
    *why = "not a host:port endpoint";
    return -1;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0 || res == nullptr) {
    *why = Fmt("cannot resolve: %s", gai_strerror(gai));
    return -1;
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = "socket: " + ErrnoText(errno);
    freeaddrinfo(res);
    return -1;
  }
  SetSocketOptions(fd);
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  const int connect_errno = errno;
  freeaddrinfo(res);
  if (rc != 0 && connect_errno != EINPROGRESS) {
    *why = "connect: " + ErrnoText(connect_errno);
    close(fd);
    return -1;
  }
  while (rc != 0) {
    const Limits lim{deadline_ns, 0, wake_fd_};
    const int ms = WaitBudgetMs(*t_, lim, 0);
    if (ms < 0) {
      *why = Fmt("connect timed out after %u ms", t_->config().connect_timeout_ms);
      close(fd);
      return -1;
    }
    int err = 0;
    const Io w = WaitFd(fd, POLLOUT, ms, wake_fd_, &err);
    if (w == Io::kWoken || w == Io::kError) {
      *why = w == Io::kWoken ? "stopped" : "poll: " + ErrnoText(err);
      close(fd);
      return -1;
    }
    if (w == Io::kTimeout) continue;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      *why = "connect: " + ErrnoText(err);
      close(fd);
      return -1;
    }
    rc = 0;
  }
  return fd;
}

kvb_status_t Lane::Handshake(int fd, const std::string& ep, uint64_t deadline_ns,
                             std::string* why) {
  const Limits lim{deadline_ns, 0, wake_fd_};
  const HandshakeResult r =
      RunHandshake(*t_, fd, KVB_AUTH_CLIENT, peer_->node_id, peer_->incarnation, lim);
  if (r.io != Io::kOk) {
    *why = r.io == Io::kTimeout
               ? Fmt("no handshake reply within %u ms", t_->config().connect_timeout_ms)
               : "handshake: " + IoError(r.io, r.err);
    return KVB_ERR_PEER_UNREACHABLE;
  }
  if (r.code != KVB_OK) {
    *why = r.why;
    if (r.code == KVB_ERR_STALE_PEER || r.code == KVB_ERR_UNAUTHENTICATED) {
      t_->Log(KVB_LOG_WARN, "handshake with %s: %s", ep.c_str(), why->c_str());
    }
  }
  return r.code;
}

bool Lane::Connect(kvb_status_t* code, std::string* msg) {
  std::vector<std::string> eps;
  size_t preferred = 0;
  {
    std::lock_guard<std::mutex> lock(peer_->mu);
    eps = peer_->endpoints;
    preferred = std::min(peer_->preferred, eps.size() - 1);
  }
  std::vector<size_t> order{preferred};
  for (size_t i = 0; i < eps.size(); ++i) {
    if (i != preferred) order.push_back(i);
  }
  auto rank = [](kvb_status_t s) {
    switch (s) {
      case KVB_ERR_STALE_PEER:
        return 4;
      case KVB_ERR_UNAUTHENTICATED:
        return 3;
      case KVB_ERR_PROTOCOL:
        return 2;
      default:
        return 1;
    }
  };
  kvb_status_t best = KVB_ERR_PEER_UNREACHABLE;
  std::string errors;
  for (size_t idx : order) {
    if (stop_.load()) {
      *code = KVB_ERR_CANCELLED;
      *msg = "peer removed";
      return false;
    }
    const uint64_t deadline = t_->Now() + t_->config().connect_timeout_ms * kMsNs;
    std::string why;
    kvb_status_t st = KVB_ERR_PEER_UNREACHABLE;
    const int fd = Dial(eps[idx], deadline, &why);
    if (fd >= 0) {
      st = Handshake(fd, eps[idx], deadline, &why);
      if (st == KVB_OK) {
        fd_ = fd;
        endpoint_ = eps[idx];
        std::lock_guard<std::mutex> lock(peer_->mu);
        if (idx < peer_->endpoints.size() && peer_->endpoints[idx] == eps[idx]) {
          peer_->preferred = idx;
        }
        return true;
      }
      close(fd);
    }
    if (stop_.load()) continue;
    errors += (errors.empty() ? "" : "; ") + eps[idx] + ": " + why;
    if (rank(st) > rank(best)) best = st;
  }
  if (stop_.load()) {
    *code = KVB_ERR_CANCELLED;
    *msg = "peer removed";
    return false;
  }
  *code = best;
  *msg = Fmt("cannot reach peer '%s' incarnation %#llx: %s", peer_->node_id.c_str(),
             U(peer_->incarnation), errors.c_str());
  return false;
}

void Lane::OnConnectFailed(kvb_status_t code, const std::string& msg) {
  Completions done;
  size_t failed = 0;
  bool log = false;
  uint64_t suppressed = 0;
  {
    std::lock_guard<std::mutex> lock(peer_->mu);
    --peer_->connecting;
    bool others = false;
    for (const auto& l : peer_->lanes) others = others || (l.get() != this && l->established);
    if (code != KVB_ERR_CANCELLED) {
      if (!others || code == KVB_ERR_STALE_PEER || code == KVB_ERR_UNAUTHENTICATED) {
        // Nothing can carry the queue: fail it now rather than at the deadline.
        failed = peer_->queue.size();
        for (auto& s : peer_->queue) t_->EndSlice(*s, code, msg, &done);
        peer_->queue.clear();
      } else {
        peer_->no_connect_before_ns = t_->Now() + t_->config().connect_timeout_ms * kMsNs;
      }
      log = peer_->connect_log.Allow(t_->Now(), &suppressed);
    }
    auto it = std::find_if(peer_->lanes.begin(), peer_->lanes.end(),
                           [this](const auto& l) { return l.get() == this; });
    std::unique_ptr<Lane> self = std::move(*it);
    peer_->lanes.erase(it);
    peer_->cv.notify_all();
    t_->Bury(std::move(self));
  }
  // The peer may be gone from here on; `msg` is our own copy.
  if (log) {
    t_->Log(KVB_LOG_WARN, "%s (failed %zu queued slices; %llu similar lines suppressed)",
            msg.c_str(), failed, U(suppressed));
  }
  Transport::RunCompletions(done);
}

uint64_t Lane::ProgressTimeoutNs() const {
  uint64_t pt = UINT64_MAX;
  for (const auto& e : inflight_) pt = std::min(pt, e.s->progress_timeout_ns);
  return pt;
}

Lane::Outcome Lane::Serve() {
  const Config& cfg = t_->config();
  const uint64_t idle_ns = cfg.idle_timeout_ms * kMsNs;
  uint64_t idle_retry_ns = 0;
  idle_since_ns_ = t_->Now();
  while (true) {
    if (stop_.load()) return {Exit::kStop, KVB_ERR_CANCELLED, "peer removed"};
    uint64_t now = t_->Now();
    Completions done;
    // Entries whose request went final or whose deadline passed: never touch their memory
    // again. One that never reached the wire just leaves; a READ's response is drained into
    // scratch; a WRITE cut mid-payload leaves the stream unusable, so the lane goes.
    for (size_t i = 0; i < inflight_.size();) {
      Entry& e = inflight_[i];
      if (!e.abandoned) {
        bool live = Live(*e.s);
        if (live && e.s->deadline_ns != 0 && now >= e.s->deadline_ns) {
          t_->EndSlice(*e.s, KVB_ERR_DEADLINE_EXCEEDED,
                       Fmt("deadline passed while in flight to %s", Name().c_str()), &done);
          live = false;
        }
        e.abandoned = !live;
      }
      if (e.abandoned && i >= send_idx_ && e.sent == 0) {
        inflight_.erase(inflight_.begin() + static_cast<ptrdiff_t>(i));
        continue;
      }
      if (e.abandoned && i == send_idx_ && e.s->opcode == KVB_OP_WRITE) {
        Transport::RunCompletions(done);
        return {Exit::kRequeue, KVB_OK, "a WRITE was abandoned mid-payload (cancel or deadline)"};
      }
      ++i;
    }
    if (!inflight_.empty() && now - last_progress_ns_ >= ProgressTimeoutNs()) {
      Transport::RunCompletions(done);
      return {Exit::kFail, KVB_ERR_PROGRESS_TIMEOUT,
              Fmt("no byte moved for %llu ms on the lane to %s",
                  U((now - last_progress_ns_) / kMsNs), Name().c_str())};
    }
    bool close_idle = false;
    if (inflight_.size() < cfg.window_slices) {
      std::lock_guard<std::mutex> lock(peer_->mu);
      while (inflight_.size() < cfg.window_slices && !peer_->queue.empty()) {
        std::unique_ptr<Slice> s = std::move(peer_->queue.front());
        peer_->queue.pop_front();
        if (!Wanted(*s)) {
          t_->EndSlice(*s, KVB_ERR_CANCELLED, "dropped", &done);
          continue;
        }
        if (s->deadline_ns != 0 && now >= s->deadline_ns) {
          t_->EndSlice(*s, KVB_ERR_DEADLINE_EXCEEDED,
                       Fmt("deadline passed before the slice was sent to '%s' (queued %llu ms)",
                           peer_->node_id.c_str(), U((now - s->posted_ns) / kMsNs)),
                       &done);
          continue;
        }
        if (inflight_.empty()) last_progress_ns_ = now;
        Entry e;
        wire::RequestHeader h;
        h.opcode = s->opcode;
        h.request_id = next_id_++;
        h.segment_id = s->segment;
        h.offset = s->offset;
        h.length = s->length;
        wire::EncodeRequestHeader(h, e.hdr);
        e.id = h.request_id;
        e.s = std::move(s);
        inflight_.push_back(std::move(e));
      }
      inflight_count.store(static_cast<uint32_t>(inflight_.size()));
      if (inflight_.empty() && idle_since_ns_ != 0 && now - idle_since_ns_ >= idle_ns &&
          now >= idle_retry_ns) {
        uint64_t next = 0;
        if (t_->idle_bucket().TryTake(now, &next)) {
          close_idle = true;
        } else {
          idle_retry_ns = next;
        }
      }
    }
    if (!inflight_.empty()) {
      idle_since_ns_ = 0;
    } else if (idle_since_ns_ == 0) {
      idle_since_ns_ = now;
    }
    Transport::RunCompletions(done);
    done.clear();
    if (close_idle) return {Exit::kIdle, KVB_OK, ""};

    uint64_t wait_ns = 1000 * kMsNs;
    if (!inflight_.empty()) {
      const uint64_t end = last_progress_ns_ + ProgressTimeoutNs();
      wait_ns = std::min(wait_ns, end > now ? end - now : 0);
      for (const auto& e : inflight_) {
        if (!e.abandoned && e.s->deadline_ns != 0) {
          wait_ns = std::min(wait_ns, e.s->deadline_ns > now ? e.s->deadline_ns - now : 0);
        }
      }
    } else {
      const uint64_t at = std::max(idle_since_ns_ + idle_ns, idle_retry_ns);
      wait_ns = std::min(wait_ns, at > now ? at - now : 0);
    }
    const int timeout_ms = static_cast<int>((wait_ns + kMsNs - 1) / kMsNs);
    const short events = POLLIN | (send_idx_ < inflight_.size() ? POLLOUT : 0);
    pollfd p[2] = {{fd_, events, 0}, {wake_fd_, POLLIN, 0}};
    const int n = poll(p, 2, timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      return {Exit::kFail, KVB_ERR_PEER_UNREACHABLE, "poll: " + ErrnoText(errno)};
    }
    if (p[1].revents & POLLIN) {
      uint64_t v;
      (void)!read(wake_fd_, &v, sizeof(v));
    }
    now = t_->Now();
    Outcome out;
    if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) && !RecvSome(now, &out, &done)) {
      Transport::RunCompletions(done);
      return out;
    }
    if ((p[0].revents & (POLLOUT | POLLERR)) && !SendSome(now, &out)) {
      Transport::RunCompletions(done);
      return out;
    }
    Transport::RunCompletions(done);
  }
}

bool Lane::SendSome(uint64_t now, Outcome* out) {
  iovec iov[kMaxIov];
  Slice* entered[kMaxIov];
  int n = 0, ne = 0;
  for (size_t i = send_idx_; i < inflight_.size() && n + 2 <= kMaxIov; ++i) {
    Entry& e = inflight_[i];
    const bool write = e.s->opcode == KVB_OP_WRITE;
    if (write) {
      if (e.abandoned || !EnterUserMem(*e.s)) {
        e.abandoned = true;  // dealt with at the top of the next loop
        break;
      }
      entered[ne++] = e.s.get();
    }
    if (e.sent < wire::kRequestHeaderBytes) {
      iov[n++] = {e.hdr + e.sent, wire::kRequestHeaderBytes - e.sent};
    }
    if (write) {
      const uint64_t done =
          e.sent > wire::kRequestHeaderBytes ? e.sent - wire::kRequestHeaderBytes : 0;
      iov[n++] = {e.s->local + done, e.s->length - done};
    }
  }
  if (n == 0) return true;
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = static_cast<size_t>(n);
  const ssize_t w = sendmsg(fd_, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
  const int err = errno;
  for (int k = 0; k < ne; ++k) ExitUserMem(*entered[k]);
  if (w < 0) {
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) return true;
    *out = {Exit::kFail, KVB_ERR_PEER_UNREACHABLE,
            Fmt("send to %s: %s", Name().c_str(), ErrnoText(err).c_str())};
    return false;
  }
  if (w > 0) last_progress_ns_ = now;
  uint64_t left = static_cast<uint64_t>(w);
  while (left > 0) {
    Entry& e = inflight_[send_idx_];
    const uint64_t take = std::min(left, e.frame_bytes() - e.sent);
    e.sent += take;
    left -= take;
    if (e.sent == e.frame_bytes()) ++send_idx_;
  }
  return true;
}

void Lane::CompleteFront(kvb_status_t code, const std::string& msg, Completions* done) {
  t_->EndSlice(*inflight_.front().s, code, msg, done);
  inflight_.pop_front();
  --send_idx_;
  inflight_count.store(static_cast<uint32_t>(inflight_.size()));
}

bool Lane::RecvSome(uint64_t now, Outcome* out, Completions* done) {
  auto protocol = [&](const std::string& why) {
    *out = {Exit::kFail, KVB_ERR_PROTOCOL, Fmt("from %s: %s", Name().c_str(), why.c_str())};
    return false;
  };
  auto socket_error = [&](ssize_t r, int err) {
    *out = {Exit::kFail, KVB_ERR_PEER_UNREACHABLE,
            r == 0 ? Fmt("%s closed the connection", Name().c_str())
                   : Fmt("recv from %s: %s", Name().c_str(), ErrnoText(err).c_str())};
    return false;
  };
  uint64_t budget = 8u << 20;  // then let the sender and the checks run
  while (budget > 0) {
    if (!in_payload_) {
      if (rhdr_got_ < sizeof(rhdr_)) {  // it may have come with the previous payload
        const ssize_t r = recv(fd_, rhdr_ + rhdr_got_, sizeof(rhdr_) - rhdr_got_, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
        if (r <= 0) return socket_error(r, errno);
        last_progress_ns_ = now;
        rhdr_got_ += static_cast<size_t>(r);
        if (rhdr_got_ < sizeof(rhdr_)) continue;
      }
      rhdr_got_ = 0;
      wire::ResponseHeader h;
      wire::DecodeResponseHeader(rhdr_, sizeof(rhdr_), &h);
      if (h.magic != wire::kResponseMagic) return protocol("bad response magic");
      if (send_idx_ == 0) return protocol("a response arrived with no request outstanding");
      Entry& e = inflight_.front();
      if (h.request_id != e.id) {
        return protocol(Fmt("response for request %llu, expected %llu", U(h.request_id), U(e.id)));
      }
      if (h.status == KVB_OK) {
        if (e.s->opcode == KVB_OP_READ) {
          if (h.length != e.s->length) return protocol("READ response length differs");
          in_payload_ = true;
          payload_got_ = 0;
          continue;
        }
        if (h.length != 0) return protocol("WRITE response carries a payload");
        CompleteFront(KVB_OK, "", done);
        continue;
      }
      if (h.length != 0) return protocol("error response carries a payload");
      std::string msg;
      switch (h.status) {
        case KVB_ERR_NOT_REGISTERED:
          msg = Fmt("peer '%s' has no registered segment %llu", peer_->node_id.c_str(),
                    U(e.s->segment));
          break;
        case KVB_ERR_OUT_OF_BOUNDS:
          msg = Fmt("[%llu, +%llu) is outside segment %llu of peer '%s'", U(e.s->offset),
                    U(e.s->length), U(e.s->segment), peer_->node_id.c_str());
          break;
        case KVB_ERR_PROTOCOL:
          msg = Fmt("peer '%s' found our request malformed", peer_->node_id.c_str());
          break;
        case KVB_ERR_INTERNAL:
          msg = Fmt("peer '%s' failed internally", peer_->node_id.c_str());
          break;
        default:
          return protocol(Fmt("unexpected response status %d", h.status));
      }
      CompleteFront(h.status, msg, done);
      if (h.status == KVB_ERR_PROTOCOL) return protocol("the peer closes the connection");
      continue;
    }
    Entry& e = inflight_.front();
    const uint64_t rest = e.s->length - payload_got_;
    const uint64_t want = std::min(rest, budget);
    const bool user = !e.abandoned && EnterUserMem(*e.s);
    iovec v[2];
    if (user) {
      v[0] = {e.s->local + payload_got_, static_cast<size_t>(want)};
    } else {
      e.abandoned = true;
      v[0] = {scratch_.get(), static_cast<size_t>(std::min<uint64_t>(want, kScratchBytes))};
    }
    // The next response's header follows this payload in the stream; when another request is
    // outstanding, take it in the same call (rhdr_got_ is 0 while a payload is read).
    msghdr m{};
    m.msg_iov = v;
    m.msg_iovlen = 1;
    if (v[0].iov_len == rest && send_idx_ > 1) {
      v[1] = {rhdr_, sizeof(rhdr_)};
      m.msg_iovlen = 2;
    }
    const ssize_t r = recvmsg(fd_, &m, MSG_DONTWAIT);
    const int err = errno;
    if (user) ExitUserMem(*e.s);
    if (r < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)) return true;
    if (r <= 0) return socket_error(r, err);
    last_progress_ns_ = now;
    const uint64_t payload_part = std::min<uint64_t>(static_cast<uint64_t>(r), v[0].iov_len);
    payload_got_ += payload_part;
    rhdr_got_ = static_cast<size_t>(static_cast<uint64_t>(r) - payload_part);
    budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(r));
    if (payload_got_ == e.s->length) {
      in_payload_ = false;
      CompleteFront(KVB_OK, "", done);
    }
  }
  return true;
}

void Lane::Teardown(const Outcome& o) {
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
  Completions done;
  {
    std::lock_guard<std::mutex> lock(peer_->mu);
    if (o.exit == Exit::kRequeue) {
      for (auto it = inflight_.rbegin(); it != inflight_.rend(); ++it) {
        if (!it->abandoned && Live(*it->s)) {
          peer_->queue.push_front(std::move(it->s));
        } else {
          t_->EndSlice(*it->s, KVB_ERR_CANCELLED, "dropped", &done);
        }
      }
    } else {
      for (auto& e : inflight_) t_->EndSlice(*e.s, o.code, o.msg, &done);
      if (o.exit == Exit::kFail && o.code == KVB_ERR_PROGRESS_TIMEOUT) {
        // The peer stopped answering (frozen process, dead path): queued work would only wait
        // for a new lane whose handshake times out too. Fail it now, so callers move on (to
        // another replica) after one progress timeout instead of that plus a connect timeout.
        for (auto& s : peer_->queue) {
          t_->EndSlice(*s, KVB_ERR_PROGRESS_TIMEOUT,
                       Fmt("not sent: %s stopped answering on another lane", Name().c_str()),
                       &done);
        }
        peer_->queue.clear();
      } else if (o.exit == Exit::kFail) {
        // Queued slices of ops that just failed would only wait for a lane to drop them;
        // ending them now lets those requests become final at once.
        std::erase_if(peer_->queue, [&](std::unique_ptr<Slice>& s) {
          if (Wanted(*s)) return false;
          t_->EndSlice(*s, KVB_ERR_CANCELLED, "dropped", &done);
          return true;
        });
      }
    }
    inflight_.clear();
    if (established) {
      t_->counters().connections_open.fetch_sub(1);
      if (o.exit == Exit::kIdle) t_->counters().connections_closed_idle.fetch_add(1);
      if (o.exit == Exit::kFail || o.exit == Exit::kRequeue) {
        t_->counters().connections_evicted.fetch_add(1);
      }
    }
    established = false;
    auto it = std::find_if(peer_->lanes.begin(), peer_->lanes.end(),
                           [this](const auto& l) { return l.get() == this; });
    std::unique_ptr<Lane> self = std::move(*it);
    peer_->lanes.erase(it);
    t_->MaybeSpawnLanes(*peer_);
    peer_->cv.notify_all();
    t_->Bury(std::move(self));
  }
  Transport::RunCompletions(done);
}

// ---------------------------------------------------------------------------------------------
// Transport: lifecycle.

Transport::Transport(const kvb_host_services_t* host, const Config& config)
    : host_(host), config_(config), idle_bucket_(config.idle_close_per_sec) {}

kvb_status_t Transport::Create(const kvb_host_services_t* host,
                               const kvb_transport_params_t* params,
                               std::unique_ptr<Transport>* out, std::string* err) {
  if (host == nullptr || params == nullptr ||
      host->struct_size < offsetof(kvb_host_services_t, now_ns) + sizeof(host->now_ns) ||
      host->log == nullptr || host->config_get == nullptr || host->now_ns == nullptr) {
    *err = "create: host services or params missing";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (!KVB_HAS_FIELD(host, kvb_host_services_t, auth_end) || host->node_id == nullptr ||
      host->incarnation == nullptr || host->auth_begin == nullptr || host->auth_need == nullptr ||
      host->auth_step == nullptr || host->auth_end == nullptr) {
    *err =
        "create: the tcp plugin needs a host with the ABI 1.2 identity and handshake services "
        "(node_id, incarnation, auth_begin ... auth_end); this host is older";
    return KVB_ERR_UNAVAILABLE;
  }
  auto has = [&](size_t offset, size_t size) { return params->struct_size >= offset + size; };
  Config config;
  if (!LoadConfig(host, &config, err)) return KVB_ERR_INVALID_ARGUMENT;
  // Who this process is comes from the host (the identity the handshake proves), not from params.
  const char* node_id = host->node_id(host->host_ctx);
  if (node_id == nullptr || node_id[0] == '\0' || strlen(node_id) > wire::kMaxNodeIdBytes) {
    *err = "create: the host's node id must be 1..255 bytes";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::unique_ptr<Transport> t(new Transport(host, config));
  t->node_id_ = node_id;
  t->incarnation_ = host->incarnation(host->host_ctx);
  std::string listen = "127.0.0.1:0";
  if (has(offsetof(kvb_transport_params_t, listen), sizeof(char*)) && params->listen != nullptr &&
      params->listen[0] != '\0') {
    listen = params->listen;
  }
  const std::vector<std::string> specs = SplitList(listen);
  if (specs.empty()) {
    *err = "create: listen list is empty";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  for (const auto& spec : specs) {
    const kvb_status_t st = t->Listen(spec, err);
    if (st != KVB_OK) return st;
  }
  for (const auto& l : t->listeners_) {
    t->endpoints_ += (t->endpoints_.empty() ? "" : ",") + l.endpoint;
  }
  t->accept_wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (t->accept_wake_fd_ < 0) {
    *err = "create: eventfd: " + ErrnoText(errno);
    return KVB_ERR_IO;
  }
  Transport* raw = t.get();
  t->accept_thread_ = std::thread([raw] { raw->AcceptLoop(); });
  t->housekeeper_ = std::thread([raw] { raw->HousekeeperLoop(); });
  t->Log(KVB_LOG_INFO, "node '%s' incarnation %#llx listening on %s", t->node_id_.c_str(),
         U(t->incarnation_), t->endpoints_.c_str());
  *out = std::move(t);
  return KVB_OK;
}

kvb_status_t Transport::Listen(const std::string& spec, std::string* err) {
  std::string host, port;
  if (!SplitHostPort(spec, &host, &port)) {
    *err = Fmt("create: listen entry '%s' is not host:port", spec.c_str());
    return KVB_ERR_INVALID_ARGUMENT;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0 || res == nullptr) {
    *err = Fmt("create: cannot resolve listen address '%s': %s", spec.c_str(), gai_strerror(gai));
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    *err = "create: socket: " + ErrnoText(errno);
    return KVB_ERR_IO;
  }
  // A restarted process can rebind the port its predecessor used at once.
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    freeaddrinfo(res);
    close(fd);
    *err = Fmt("create: cannot listen on %s: %s", spec.c_str(), ErrnoText(e).c_str());
    return KVB_ERR_IO;
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  const uint16_t bound = ss.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  const bool v6 = host.find(':') != std::string::npos;
  listeners_.push_back(
      {fd, Fmt(v6 ? "[%s]:%u" : "%s:%u", host.empty() ? "0.0.0.0" : host.c_str(), bound)});
  return KVB_OK;
}

Transport::~Transport() {
  stopping_.store(true);
  if (accept_wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(accept_wake_fd_, &one, sizeof(one));
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    std::lock_guard<std::mutex> lock(hk_mu_);
    hk_cv_.notify_all();
  }
  if (housekeeper_.joinable()) housekeeper_.join();
  std::vector<Peer*> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers.assign(peers_.begin(), peers_.end());
  }
  for (Peer* p : peers) RemovePeer(p);
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    for (auto& c : inbound_) shutdown(c->fd, SHUT_RDWR);
  }
  ReapInbound(/*all=*/true);
  JoinGraveyard();
  prefailed_.clear();
  for (auto& l : listeners_) close(l.fd);
  if (accept_wake_fd_ >= 0) close(accept_wake_fd_);
}

void Transport::Log(int32_t level, const char* fmt, ...) const {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  host_->log(host_->host_ctx, level, "tcp", buf);
}

void Transport::RunCompletions(const Completions& done) {
  for (const auto& c : done) c.fn(c.user);
}

void Transport::Bury(std::unique_ptr<Lane> lane) {
  std::lock_guard<std::mutex> lock(graveyard_mu_);
  graveyard_.push_back(std::move(lane));
}

void Transport::JoinGraveyard() {
  std::vector<std::unique_ptr<Lane>> dead;
  {
    std::lock_guard<std::mutex> lock(graveyard_mu_);
    dead.swap(graveyard_);
  }
  for (auto& l : dead) {
    if (l->thread.joinable()) l->thread.join();
  }
}

int32_t Transport::GetEndpoints(char* buf, uint32_t buf_len) const {
  if (buf == nullptr || endpoints_.size() + 1 > buf_len) return -2;
  std::memcpy(buf, endpoints_.c_str(), endpoints_.size() + 1);
  return static_cast<int32_t>(endpoints_.size());
}

// ---------------------------------------------------------------------------------------------
// Server side.

void Transport::AcceptLoop() {
  std::vector<pollfd> fds;
  for (const auto& l : listeners_) fds.push_back({l.fd, POLLIN, 0});
  fds.push_back({accept_wake_fd_, POLLIN, 0});
  while (!stopping_.load()) {
    const int n = poll(fds.data(), fds.size(), 1000);
    ReapInbound(/*all=*/false);
    if (n <= 0) continue;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      while (!stopping_.load()) {
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        const int fd = accept4(fds[i].fd, reinterpret_cast<sockaddr*>(&ss), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if (errno != EAGAIN && errno != EWOULDBLOCK) {
            uint64_t suppressed = 0;
            if (inbound_refusal_log_.Allow(Now(), &suppressed)) {
              Log(KVB_LOG_WARN, "accept on %s: %s", listeners_[i].endpoint.c_str(),
                  ErrnoText(errno).c_str());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          break;
        }
        const std::string addr = AddrText(ss);
        const std::string source = SourceText(ss);
        size_t from_source = 0;
        {
          std::lock_guard<std::mutex> lock(inbound_mu_);
          for (const auto& c : inbound_) from_source += !c->done.load() && c->source == source;
        }
        if (from_source >= config_.max_inbound_per_source) {
          uint64_t suppressed = 0;
          if (inbound_refusal_log_.Allow(Now(), &suppressed)) {
            Log(KVB_LOG_WARN,
                "refusing inbound connection from %s: %zu connections open from %s "
                "(tcp.max_inbound_per_source); %llu similar refusals suppressed",
                addr.c_str(), from_source, source.c_str(), U(suppressed));
          }
          close(fd);
          continue;
        }
        if (counters_.inbound_open.load() >= config_.max_inbound) {
          uint64_t suppressed = 0;
          if (inbound_refusal_log_.Allow(Now(), &suppressed)) {
            Log(KVB_LOG_WARN,
                "refusing inbound connection from %s: %u connections open "
                "(tcp.max_inbound); %llu similar refusals suppressed",
                addr.c_str(), config_.max_inbound, U(suppressed));
          }
          close(fd);
          continue;
        }
        SetSocketOptions(fd);
        auto conn = std::make_unique<Inbound>();
        conn->fd = fd;
        conn->addr = addr;
        conn->source = source;
        Inbound* raw = conn.get();
        counters_.inbound_open.fetch_add(1);
        std::lock_guard<std::mutex> lock(inbound_mu_);
        inbound_.push_back(std::move(conn));
        try {
          raw->thread = std::thread([this, raw] { ServeInbound(raw); });
        } catch (const std::exception& e) {
          inbound_.pop_back();
          close(fd);
          counters_.inbound_open.fetch_sub(1);
          Log(KVB_LOG_WARN, "cannot start a thread for inbound %s: %s", addr.c_str(), e.what());
        }
      }
    }
    if (fds.back().revents & POLLIN) {
      uint64_t v;
      (void)!read(accept_wake_fd_, &v, sizeof(v));
    }
  }
}

void Transport::ReapInbound(bool all) {
  std::list<std::unique_ptr<Inbound>> dead;
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    for (auto it = inbound_.begin(); it != inbound_.end();) {
      auto next = std::next(it);
      if (all || (*it)->done.load()) dead.splice(dead.end(), inbound_, it);
      it = next;
    }
  }
  for (auto& c : dead) {
    if (c->thread.joinable()) c->thread.join();
    close(c->fd);  // only here, after the join: no thread can use a reused descriptor number
  }
}

void Transport::ServeInbound(Inbound* conn) {
  try {
    if (ServerHandshake(conn->fd, conn->addr)) ServeRequests(conn->fd, conn->addr);
  } catch (const std::exception& e) {
    Log(KVB_LOG_ERROR, "inbound %s: internal error: %s", conn->addr.c_str(), e.what());
  }
  shutdown(conn->fd, SHUT_RDWR);
  counters_.inbound_open.fetch_sub(1);
  conn->done.store(true);
}

bool Transport::ServerHandshake(int fd, const std::string& addr) {
  const Limits lim{Now() + config_.connect_timeout_ms * kMsNs, 0, -1};
  const HandshakeResult r = RunHandshake(*this, fd, KVB_AUTH_SERVER, "", 0, lim);
  if (r.io == Io::kTimeout) {
    Log(KVB_LOG_INFO, "inbound %s: handshake not finished within %u ms; closing", addr.c_str(),
        config_.connect_timeout_ms);
  }
  if (r.io != Io::kOk) return false;
  if (r.code != KVB_OK) {
    counters_.frames_rejected.fetch_add(1);
    Log(KVB_LOG_WARN, "inbound %s: %s", addr.c_str(), r.why.c_str());
    return false;
  }
  return true;
}

std::shared_ptr<Transport::Region> Transport::AcquireRegion(uint64_t segment_id, int fd) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  auto it = regions_.find(segment_id);
  if (it == regions_.end()) return nullptr;
  ++it->second->in_use;
  it->second->users.push_back(fd);
  return it->second;
}

void Transport::ReleaseRegion(const std::shared_ptr<Region>& region, int fd) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  auto& u = region->users;
  if (auto it = std::find(u.begin(), u.end(), fd); it != u.end()) {
    *it = u.back();
    u.pop_back();
  }
  if (--region->in_use == 0) regions_cv_.notify_all();
}

void Transport::ServeRequests(int fd, const std::string& addr) {
  const uint64_t progress_ns = config_.progress_timeout_ms * kMsNs;
  const Limits io_lim{0, progress_ns, -1};
  // A payload of n bytes, in or out, must also be done by an absolute deadline: the progress
  // timeout plus n at tcp.min_inbound_bytes_per_sec. A peer trickling a byte now and then
  // cannot hold a region (and a DeregisterMemory waiting on it) for ever.
  auto payload_lim = [&](uint64_t n) {
    const uint64_t ns = static_cast<uint64_t>(static_cast<double>(n) * 1e9 /
                                              static_cast<double>(config_.min_inbound_bytes_per_sec));
    return Limits{Now() + progress_ns + ns, progress_ns, -1};
  };
  std::unique_ptr<uint8_t[]> scratch;
  int err = 0;
  // Read-ahead: one recv picks up every request header a lane has pipelined. A WRITE's payload
  // may start inside it; those bytes are copied out before the rest is received in place.
  constexpr size_t kReadAhead = 4096;
  uint8_t in[kReadAhead];
  size_t in_begin = 0, in_end = 0;
  uint64_t last_in_ns = Now();
  auto buffered = [&] { return in_end - in_begin; };
  // Responses are gathered and sent with one sendmsg once no further request is waiting (or
  // the batch is full): a burst of pipelined READs costs one send, and the stream fills whole
  // segments instead of trailing a few bytes after every payload. A READ's region stays
  // acquired until its payload is sent.
  constexpr int kMaxBatch = kMaxIov / 2;
  constexpr uint64_t kMaxBatchBytes = 8u << 20;
  uint8_t rbs[kMaxBatch][wire::kResponseHeaderBytes];
  iovec iov[kMaxIov];
  std::shared_ptr<Region> held[kMaxBatch];
  int nresp = 0, niov = 0;
  uint64_t batch_bytes = 0;
  auto flush = [&]() -> Io {
    if (nresp == 0) return Io::kOk;
    const Io io = SendAllV(*this, fd, iov, niov, payload_lim(batch_bytes), &err);
    for (int i = 0; i < nresp; ++i) {
      if (held[i]) ReleaseRegion(held[i], fd);
      held[i].reset();
    }
    nresp = niov = 0;
    batch_bytes = 0;
    return io;
  };
  auto queue = [&](const wire::ResponseHeader& resp, uint8_t* payload,
                   std::shared_ptr<Region> region) -> Io {
    wire::EncodeResponseHeader(resp, rbs[nresp]);
    iov[niov++] = {rbs[nresp], wire::kResponseHeaderBytes};
    batch_bytes += wire::kResponseHeaderBytes;
    if (payload != nullptr) {
      iov[niov++] = {payload, static_cast<size_t>(resp.length)};
      batch_bytes += resp.length;
    }
    held[nresp++] = std::move(region);
    return nresp == kMaxBatch || batch_bytes >= kMaxBatchBytes ? flush() : Io::kOk;
  };
  auto recv_payload = [&](uint8_t* dst, uint64_t len) -> Io {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(len, buffered()));
    if (dst != nullptr) memcpy(dst, in + in_begin, take);
    in_begin += take;
    if (take == len) return Io::kOk;
    // Responses gathered so far go out only if the payload has to be waited for.
    const std::function<Io()> before_wait = [&] { return flush(); };
    const Limits lim = payload_lim(len - take);
    if (dst != nullptr) return RecvAll(*this, fd, dst + take, len - take, lim, &err, before_wait);
    // Drain into scratch: a refused WRITE's payload never touches a region.
    if (!scratch) scratch = std::make_unique<uint8_t[]>(kScratchBytes);
    for (uint64_t left = len - take; left > 0;) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, kScratchBytes));
      const Io io = RecvAll(*this, fd, scratch.get(), chunk, lim, &err, before_wait);
      if (io != Io::kOk) return io;
      left -= chunk;
    }
    return Io::kOk;
  };
  auto log_send_failure = [&](Io io) {
    if (io != Io::kClosed) {
      Log(KVB_LOG_WARN, "closing inbound %s while sending responses: %s", addr.c_str(),
          io == Io::kTimeout ? "no progress within tcp.progress_timeout_ms"
                             : IoError(io, err).c_str());
    }
  };
  while (!stopping_.load()) {
    if (buffered() < wire::kRequestHeaderBytes) {
      memmove(in, in + in_begin, buffered());
      in_end = buffered();
      in_begin = 0;
      const ssize_t r = recv(fd, in + in_end, kReadAhead - in_end, MSG_DONTWAIT);
      if (r > 0) {
        in_end += static_cast<size_t>(r);
        last_in_ns = Now();
        continue;
      }
      if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        (void)flush();  // best effort: the peer is gone or going
        return;
      }
      if (errno == EINTR) continue;
      // Nothing more right now: send what is gathered before waiting.
      if (const Io io = flush(); io != Io::kOk) {
        log_send_failure(io);
        return;
      }
      int wait_ms = 1000;
      if (in_end == 0 && Now() - last_in_ns > config_.inbound_idle_timeout_ms * kMsNs) {
        Log(KVB_LOG_INFO, "closing inbound %s: no request for %u ms (tcp.inbound_idle_timeout_ms)",
            addr.c_str(), config_.inbound_idle_timeout_ms);
        return;
      }
      if (in_end > 0) {  // a partial header must complete within the progress timeout
        wait_ms = WaitBudgetMs(*this, io_lim, last_in_ns);
        if (wait_ms < 0) {
          Log(KVB_LOG_WARN, "closing inbound %s: request header stalled for %u ms", addr.c_str(),
              config_.progress_timeout_ms);
          return;
        }
      }
      if (WaitFd(fd, POLLIN, wait_ms, -1, &err) == Io::kError) return;
      continue;
    }
    wire::RequestHeader h;
    wire::DecodeRequestHeader(in + in_begin, wire::kRequestHeaderBytes, &h);
    in_begin += wire::kRequestHeaderBytes;
    std::shared_ptr<Region> region =
        h.magic == wire::kRequestMagic ? AcquireRegion(h.segment_id, fd) : nullptr;
    wire::RegionRef ref;
    if (region) ref = {region->base, region->length};
    const wire::RequestCheck check =
        wire::CheckRequest(h, region ? &ref : nullptr, config_.max_frame_bytes);
    wire::ResponseHeader resp;
    resp.status = check.status;
    resp.request_id = h.request_id;
    if (check.status == KVB_ERR_PROTOCOL) {
      if (region) ReleaseRegion(region, fd);
      counters_.frames_rejected.fetch_add(1);
      Log(KVB_LOG_WARN,
          "closing inbound %s: %s (magic %#x opcode %u flags %#x segment %llu offset %llu "
          "length %llu)",
          addr.c_str(), check.reason, h.magic, h.opcode, h.flags, U(h.segment_id), U(h.offset),
          U(h.length));
      if (flush() != Io::kOk) return;
      uint8_t rb[wire::kResponseHeaderBytes];
      wire::EncodeResponseHeader(resp, rb);
      (void)!send(fd, rb, sizeof(rb), MSG_NOSIGNAL | MSG_DONTWAIT);
      return;
    }
    Io io = Io::kOk;
    if (check.status != KVB_OK) {
      if (region) ReleaseRegion(region, fd);
      counters_.frames_rejected.fetch_add(1);
      uint64_t suppressed = 0;
      if (reject_log_.Allow(Now(), &suppressed)) {
        Log(KVB_LOG_WARN,
            "refused request from %s: %s (segment %llu offset %llu length %llu); %llu similar "
            "lines suppressed",
            addr.c_str(), check.reason, U(h.segment_id), U(h.offset), U(h.length), U(suppressed));
      }
      // Drain the payload so the connection stays usable.
      if (h.opcode == KVB_OP_WRITE) io = recv_payload(nullptr, h.length);
      if (io == Io::kOk) io = queue(resp, nullptr, nullptr);
    } else if (h.opcode == KVB_OP_READ) {
      resp.length = h.length;
      uint8_t* payload = region->base + h.offset;
      io = queue(resp, payload, std::move(region));
    } else {
      io = recv_payload(region->base + h.offset, h.length);
      ReleaseRegion(region, fd);
      if (io == Io::kOk) io = queue(resp, nullptr, nullptr);
    }
    if (io != Io::kOk) {
      if (io != Io::kClosed) {
        Log(KVB_LOG_WARN, "closing inbound %s during a %s of %llu bytes: %s", addr.c_str(),
            h.opcode == KVB_OP_READ ? "READ" : "WRITE", U(h.length),
            io == Io::kTimeout ? "no progress within tcp.progress_timeout_ms, or past the "
                                 "payload's bound (tcp.min_inbound_bytes_per_sec)"
                               : IoError(io, err).c_str());
      }
      (void)flush();
      return;
    }
    last_in_ns = Now();  // idleness counts from the end of the last request
  }
  (void)flush();
}

// ---------------------------------------------------------------------------------------------
// Memory registration.

kvb_status_t Transport::RegisterMemory(const kvb_region_t* region, uint8_t* rkey, uint32_t rkey_cap,
                                       uint32_t* rkey_len) {
  if (region == nullptr ||
      region->struct_size < offsetof(kvb_region_t, length) + sizeof(region->length)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (region->mem_kind != KVB_MEM_HOST) return KVB_ERR_UNSUPPORTED;
  if (region->addr == nullptr || region->length == 0) return KVB_ERR_INVALID_ARGUMENT;
  auto r = std::make_shared<Region>();
  r->base = static_cast<uint8_t*>(region->addr);
  r->length = region->length;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    if (!regions_.emplace(region->segment_id, r).second) return KVB_ERR_ALREADY_EXISTS;
  }
  if (rkey_len != nullptr) *rkey_len = 0;  // tcp needs no remote key
  return KVB_OK;
}

kvb_status_t Transport::DeregisterMemory(uint64_t segment_id) {
  std::unique_lock<std::mutex> lock(regions_mu_);
  auto it = regions_.find(segment_id);
  if (it == regions_.end()) return KVB_ERR_NOT_FOUND;
  std::shared_ptr<Region> r = it->second;
  regions_.erase(it);
  // Connections still inside the region (a WRITE being received, a READ being sent) are shut
  // down rather than waited for: a stalled or trickling peer cannot hold this call. Their
  // threads leave at once (recv/send fail); the descriptors stay valid until then, as a
  // connection is closed only after its thread ended.
  if (r->in_use > 0) {
    Log(KVB_LOG_WARN, "deregistering segment %llu: cutting %zu inbound connection(s) still using it",
        U(segment_id), r->users.size());
    for (int fd : r->users) shutdown(fd, SHUT_RDWR);
  }
  regions_cv_.wait(lock, [&] { return r->in_use == 0; });
  return KVB_OK;
}

// ---------------------------------------------------------------------------------------------
// Peers.

namespace {

// Reads endpoints and segments from a peer info; false with *err on malformed input.
bool ParsePeerInfo(const kvb_peer_info_t* info, std::vector<std::string>* endpoints,
                   std::unordered_map<uint64_t, uint64_t>* segments, std::string* err) {
  if (info == nullptr ||
      info->struct_size < offsetof(kvb_peer_info_t, num_segments) + sizeof(uint32_t)) {
    *err = "peer info missing or too small";
    return false;
  }
  if (info->node_id == nullptr || info->node_id[0] == '\0' ||
      strlen(info->node_id) > wire::kMaxNodeIdBytes) {
    *err = "peer node_id must be 1..255 bytes";
    return false;
  }
  *endpoints = SplitList(info->endpoints != nullptr ? info->endpoints : "");
  if (endpoints->empty()) {
    *err = Fmt("peer '%s' publishes no tcp endpoint", info->node_id);
    return false;
  }
  for (const auto& ep : *endpoints) {
    std::string host, port;
    if (!SplitHostPort(ep, &host, &port) || host.empty()) {
      *err = Fmt("peer '%s': endpoint '%s' is not host:port", info->node_id, ep.c_str());
      return false;
    }
  }
  if (info->num_segments > 0) {
    if (info->segments == nullptr) {
      *err = "peer segments missing";
      return false;
    }
    // Elements are segment_size bytes apart (the host's sizeof(kvb_peer_segment_t)).
    const uint32_t stride = info->segment_size;
    if (stride < offsetof(kvb_peer_segment_t, length) + sizeof(uint64_t)) {
      *err = "peer segment struct_size too small";
      return false;
    }
    const auto* base = reinterpret_cast<const uint8_t*>(info->segments);
    for (uint32_t i = 0; i < info->num_segments; ++i) {
      const auto* s = reinterpret_cast<const kvb_peer_segment_t*>(base + size_t(i) * stride);
      (*segments)[s->segment_id] = s->length;
    }
  }
  return true;
}

}  // namespace

kvb_status_t Transport::AddPeer(const kvb_peer_info_t* info, Peer** out, std::string* err) {
  if (out == nullptr) {
    *err = "add_peer: out is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  auto peer = std::make_unique<Peer>();
  if (!ParsePeerInfo(info, &peer->endpoints, &peer->segment_lengths, err)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  peer->node_id = info->node_id;
  peer->incarnation = info->incarnation;
  std::lock_guard<std::mutex> lock(peers_mu_);
  *out = peer.get();
  peers_.insert(peer.release());
  return KVB_OK;
}

kvb_status_t Transport::UpdatePeer(Peer* peer, const kvb_peer_info_t* info, std::string* err) {
  std::vector<std::string> endpoints;
  std::unordered_map<uint64_t, uint64_t> segments;
  if (peer == nullptr) {
    *err = "update_peer: peer is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (!ParsePeerInfo(info, &endpoints, &segments, err)) return KVB_ERR_INVALID_ARGUMENT;
  if (peer->node_id != info->node_id || peer->incarnation != info->incarnation) {
    *err = "update_peer: another incarnation is another peer (use add_peer)";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(peer->mu);
  const std::string preferred = peer->endpoints[peer->preferred];
  peer->endpoints = std::move(endpoints);
  auto it = std::find(peer->endpoints.begin(), peer->endpoints.end(), preferred);
  peer->preferred = it == peer->endpoints.end() ? 0 : it - peer->endpoints.begin();
  peer->segment_lengths = std::move(segments);
  return KVB_OK;
}

void Transport::RemovePeer(Peer* peer) {
  if (peer == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers_.erase(peer);
  }
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    peer->removing = true;
    live.swap(peer->live);
    for (auto& l : peer->lanes) l->Stop();
  }
  for (auto& r : live) CancelRequest(r);
  {
    std::unique_lock<std::mutex> lock(peer->mu);
    peer->cv.wait(lock, [&] { return peer->lanes.empty(); });
    peer->queue.clear();
  }
  JoinGraveyard();
  delete peer;
}

// ---------------------------------------------------------------------------------------------
// Requests.

void Transport::Finalize(Request& req, Completions* done) {
  req.final = true;
  if (req.peer != nullptr) {
    req.peer->queued_bytes.fetch_sub(req.charged_bytes);
    req.peer->queued_slices.fetch_sub(req.charged_slices);
  }
  counters_.queued_bytes.fetch_sub(req.charged_bytes);
  req.peer = nullptr;
  if (req.on_complete != nullptr) done->push_back({req.on_complete, req.user});
  req.cv.notify_all();
}

void Transport::EndSlice(Slice& s, kvb_status_t code, const std::string& msg, Completions* done) {
  Request& r = *s.req;
  std::lock_guard<std::mutex> lock(r.mu);
  if (s.ended) return;
  s.ended = true;
  if (r.final) return;
  OpState& op = r.ops[s.op];
  if (code != KVB_OK && op.error == KVB_OK) {
    op.error = code;
    op.msg = msg;
  }
  if (++op.ended_slices == op.total_slices) {
    op.status = op.error;
    if (op.error == KVB_OK) {
      (op.opcode == KVB_OP_READ ? counters_.bytes_read : counters_.bytes_written)
          .fetch_add(op.length);
    }
  }
  if (--r.outstanding_slices == 0) Finalize(r, done);
}

void Transport::CancelRequest(const std::shared_ptr<Request>& req) {
  Completions done;
  {
    std::unique_lock<std::mutex> lock(req->mu);
    if (!req->final) {
      for (auto& op : req->ops) {
        if (op.status != KVB_IN_PROGRESS) continue;
        op.status = op.error != KVB_OK ? op.error : KVB_ERR_CANCELLED;
        if (op.error == KVB_OK) op.msg = "cancelled";
      }
      Finalize(*req, &done);
    }
    // Lanes only touch user memory inside a nonblocking send/recv, so this is brief.
    req->cv.wait(lock, [&] { return req->in_user_mem == 0; });
  }
  RunCompletions(done);
}

void Transport::WakeHousekeeper(uint64_t deadline_ns) {
  std::lock_guard<std::mutex> lock(hk_mu_);
  if (deadline_ns < hk_next_wake_ns_) {
    hk_next_wake_ns_ = deadline_ns;
    hk_cv_.notify_all();
  }
}

kvb_status_t Transport::Post(Peer* peer, const kvb_xfer_op_t* ops, uint32_t op_size, uint32_t count,
                             const kvb_post_opts_t* opts, RequestHandle** out, std::string* err) {
  if (peer == nullptr || out == nullptr || ops == nullptr || count == 0) {
    *err = "post: peer, ops and out are required and count must be > 0";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (op_size < sizeof(kvb_xfer_op_t)) {
    *err =
        Fmt("post: op_size %u is smaller than kvb_xfer_op_t (%zu)", op_size, sizeof(kvb_xfer_op_t));
    return KVB_ERR_INVALID_ARGUMENT;
  }
  uint64_t deadline_ns = 0;
  uint64_t progress_ns = config_.progress_timeout_ms * kMsNs;
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  if (opts != nullptr) {
    auto has = [&](size_t offset, size_t size) { return opts->struct_size >= offset + size; };
    if (has(offsetof(kvb_post_opts_t, deadline_ns), 8)) deadline_ns = opts->deadline_ns;
    if (has(offsetof(kvb_post_opts_t, progress_timeout_ns), 8) && opts->progress_timeout_ns) {
      progress_ns = opts->progress_timeout_ns;
    }
    if (has(offsetof(kvb_post_opts_t, user), sizeof(void*))) {
      on_complete = opts->on_complete;
      user = opts->user;
    }
  }
  auto op_at = [&](uint32_t i) -> const kvb_xfer_op_t& {
    return *reinterpret_cast<const kvb_xfer_op_t*>(reinterpret_cast<const uint8_t*>(ops) +
                                                   size_t(i) * op_size);
  };
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    for (uint32_t i = 0; i < count; ++i) {
      const kvb_xfer_op_t& op = op_at(i);
      if (op.opcode != KVB_OP_READ && op.opcode != KVB_OP_WRITE) {
        *err = Fmt("post: op %u: opcode %u is neither READ nor WRITE", i, op.opcode);
        return KVB_ERR_INVALID_ARGUMENT;
      }
      if (op.local_addr == nullptr || op.length == 0) {
        *err = Fmt("post: op %u: null local address or zero length", i);
        return KVB_ERR_INVALID_ARGUMENT;
      }
      auto it = regions_.find(op.local_segment);
      const auto addr = reinterpret_cast<uintptr_t>(op.local_addr);
      const auto base = it == regions_.end() ? 0 : reinterpret_cast<uintptr_t>(it->second->base);
      if (it == regions_.end() || addr < base || addr - base > it->second->length ||
          op.length > it->second->length - (addr - base)) {
        *err = Fmt("post: op %u: local memory [%p, +%llu) is not inside registered segment %llu", i,
                   op.local_addr, U(op.length), U(op.local_segment));
        return KVB_ERR_NOT_REGISTERED;
      }
    }
  }
  auto req = std::make_shared<Request>();
  req->peer = peer;
  req->ops.resize(count);
  req->on_complete = on_complete;
  req->user = user;
  auto handle = std::make_unique<RequestHandle>();
  handle->req = req;
  const uint64_t now = Now();
  auto make_slice = [&](uint32_t i) {
    auto s = std::make_unique<Slice>();
    const kvb_xfer_op_t& op = op_at(i);
    s->req = req;
    s->op = i;
    s->opcode = static_cast<uint16_t>(op.opcode);
    s->segment = op.remote_segment;
    s->deadline_ns = deadline_ns;
    s->progress_timeout_ns = progress_ns;
    s->posted_ns = now;
    return s;
  };
  std::vector<std::unique_ptr<Slice>> slices;
  std::vector<PrefailedOp> prefailed;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    if (peer->removing) {
      *err = "post: the peer is being removed";
      return KVB_ERR_NOT_FOUND;
    }
    // Slices are admitted like bytes, and counted before any is made: each costs the transport
    // memory whatever its length, so many tiny ops are bounded here where their bytes never
    // reach the byte bound.
    uint64_t nslices = 0;
    for (uint32_t i = 0; i < count; ++i) {
      const kvb_xfer_op_t& op = op_at(i);
      auto seg = peer->segment_lengths.find(op.remote_segment);
      const bool prefails =
          seg != peer->segment_lengths.end() &&
          (op.remote_offset > seg->second || op.length > seg->second - op.remote_offset);
      nslices += prefails ? 1 : (op.length - 1) / config_.slice_bytes + 1;
    }
    const uint64_t queued_slices = peer->queued_slices.load();
    const uint64_t max_slices = config_.max_queued_slices_per_peer;
    if (queued_slices > 0 &&
        (queued_slices > max_slices || nslices > max_slices - queued_slices)) {
      *err =
          Fmt("post: peer '%s' has %llu slices queued; %llu more exceed "
              "tcp.max_queued_slices_per_peer (%llu)",
              peer->node_id.c_str(), U(queued_slices), U(nslices), U(max_slices));
      return KVB_ERR_BACKPRESSURE;
    }
    slices.reserve(nslices);
    for (uint32_t i = 0; i < count; ++i) {
      const kvb_xfer_op_t& op = op_at(i);
      OpState& st = req->ops[i];
      st.opcode = static_cast<uint16_t>(op.opcode);
      st.length = op.length;
      auto seg = peer->segment_lengths.find(op.remote_segment);
      if (seg != peer->segment_lengths.end() &&
          (op.remote_offset > seg->second || op.length > seg->second - op.remote_offset)) {
        // Refused without I/O; reported through the housekeeper, never from inside post.
        st.total_slices = 1;
        prefailed.push_back({make_slice(i), KVB_ERR_OUT_OF_BOUNDS,
                             Fmt("op %u: [%llu, +%llu) is outside segment %llu of peer '%s' "
                                 "(%llu bytes)",
                                 i, U(op.remote_offset), U(op.length), U(op.remote_segment),
                                 peer->node_id.c_str(), U(seg->second))});
        continue;
      }
      if (bytes + op.length < bytes) {
        *err = "post: total length overflows";
        return KVB_ERR_INVALID_ARGUMENT;
      }
      bytes += op.length;
      for (uint64_t off = 0; off < op.length; off += config_.slice_bytes) {
        auto s = make_slice(i);
        s->local = static_cast<uint8_t*>(op.local_addr) + off;
        s->offset = op.remote_offset + off;
        s->length = std::min(config_.slice_bytes, op.length - off);
        slices.push_back(std::move(s));
        ++st.total_slices;
      }
    }
    const uint64_t queued = peer->queued_bytes.load();
    const uint64_t max = config_.max_queued_bytes_per_peer;
    if (queued > 0 && (queued > max || bytes > max - queued)) {
      *err =
          Fmt("post: peer '%s' has %llu bytes queued; %llu more exceed "
              "tcp.max_queued_bytes_per_peer (%llu)",
              peer->node_id.c_str(), U(queued), U(bytes), U(max));
      return KVB_ERR_BACKPRESSURE;
    }
    req->outstanding_slices = nslices;  // == slices.size() + prefailed.size()
    req->charged_bytes = bytes;
    req->charged_slices = nslices;
    peer->queued_bytes.fetch_add(bytes);
    peer->queued_slices.fetch_add(nslices);
    counters_.queued_bytes.fetch_add(bytes);
    for (auto& s : slices) peer->queue.push_back(std::move(s));
    peer->live.push_back(req);
    if (peer->live.size() >= peer->prune_live_at) {
      std::erase_if(peer->live, [](const std::shared_ptr<Request>& r) {
        std::lock_guard<std::mutex> rlock(r->mu);
        return r->final;
      });
      peer->prune_live_at = std::max<size_t>(64, 2 * peer->live.size());
    }
    MaybeSpawnLanes(*peer);
    for (auto& l : peer->lanes) {
      if (l->established) l->Wake();
    }
  }
  if (!prefailed.empty()) {
    std::lock_guard<std::mutex> lock(hk_mu_);
    for (auto& p : prefailed) prefailed_.push_back(std::move(p));
    hk_cv_.notify_all();
  } else if (deadline_ns != 0) {
    WakeHousekeeper(deadline_ns);
  }
  *out = handle.release();
  return KVB_OK;
}

void Transport::MaybeSpawnLanes(Peer& peer) {
  if (peer.removing || stopping() || peer.queue.empty() || peer.connecting > 0 ||
      peer.lanes.size() >= config_.lanes_per_peer) {
    return;
  }
  uint64_t free_slots = 0;
  bool any_established = false;
  for (const auto& l : peer.lanes) {
    if (!l->established) continue;
    any_established = true;
    const uint32_t in = l->inflight_count.load();
    free_slots += in < config_.window_slices ? config_.window_slices - in : 0;
  }
  if (any_established && (peer.queue.size() <= free_slots || Now() < peer.no_connect_before_ns)) {
    return;
  }
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) {
    Log(KVB_LOG_WARN, "cannot open a lane to '%s': eventfd: %s", peer.node_id.c_str(),
        ErrnoText(errno).c_str());
    return;
  }
  auto lane = std::make_unique<Lane>(this, &peer, wake_fd);
  Lane* raw = lane.get();
  peer.lanes.push_back(std::move(lane));
  ++peer.connecting;
  try {
    raw->thread = std::thread([raw] { raw->Run(); });
  } catch (const std::exception& e) {
    --peer.connecting;
    peer.lanes.pop_back();
    Log(KVB_LOG_WARN, "cannot start a lane thread for '%s': %s", peer.node_id.c_str(), e.what());
  }
}

kvb_status_t Transport::Poll(RequestHandle* h, kvb_status_t* op_status, uint32_t op_status_len,
                             char* err, uint32_t err_len) {
  if (h == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  Request& r = *h->req;
  std::lock_guard<std::mutex> lock(r.mu);
  if (op_status != nullptr) {
    for (uint32_t i = 0; i < op_status_len && i < r.ops.size(); ++i) op_status[i] = r.ops[i].status;
  }
  if (!r.final) {
    kvb_copy_message(err, err_len, "");
    return KVB_IN_PROGRESS;
  }
  for (const auto& op : r.ops) {
    if (op.status != KVB_OK) {
      kvb_copy_message(err, err_len, op.msg.c_str());
      return op.status;
    }
  }
  kvb_copy_message(err, err_len, "");
  return KVB_OK;
}

void Transport::Cancel(RequestHandle* h) {
  if (h != nullptr) CancelRequest(h->req);
}

void Transport::Release(RequestHandle* h) {
  if (h == nullptr) return;
  CancelRequest(h->req);  // a no-op for a final request; keeps a host bug from going unseen
  delete h;
}

kvb_status_t Transport::GetStats(kvb_transport_stats_t* stats) const {
  if (stats == nullptr || stats->struct_size < sizeof(uint32_t)) return KVB_ERR_INVALID_ARGUMENT;
  kvb_transport_stats_t s{};
  s.connections_open = counters_.connections_open.load();
  s.connections_opened = counters_.connections_opened.load();
  s.connections_closed_idle = counters_.connections_closed_idle.load();
  s.connections_evicted = counters_.connections_evicted.load();
  s.inbound_open = counters_.inbound_open.load();
  s.bytes_written = counters_.bytes_written.load();
  s.bytes_read = counters_.bytes_read.load();
  s.frames_rejected = counters_.frames_rejected.load();
  s.queued_bytes = counters_.queued_bytes.load();
  const uint32_t size = stats->struct_size;
  std::memcpy(stats, &s, std::min<size_t>(size, sizeof(s)));
  stats->struct_size = size;
  return KVB_OK;
}

// ---------------------------------------------------------------------------------------------
// Housekeeper: deadlines of queued slices, pre-failed ops, lane thread joins.

void Transport::HousekeeperLoop() {
  std::unique_lock<std::mutex> lock(hk_mu_);
  hk_next_wake_ns_ = Now();
  while (!stopping_.load()) {
    while (!stopping_.load() && prefailed_.empty()) {
      const uint64_t now = Now();
      if (now >= hk_next_wake_ns_) break;
      hk_cv_.wait_for(lock, std::chrono::nanoseconds(hk_next_wake_ns_ - now));
    }
    if (stopping_.load()) break;
    std::vector<PrefailedOp> prefailed;
    prefailed.swap(prefailed_);
    hk_next_wake_ns_ = UINT64_MAX;  // posts arriving now lower it
    lock.unlock();
    JoinGraveyard();
    Completions done;
    for (auto& p : prefailed) EndSlice(*p.slice, p.code, p.msg, &done);
    const uint64_t now = Now();
    uint64_t next = now + 250 * kMsNs;
    {
      std::lock_guard<std::mutex> peers_lock(peers_mu_);
      for (Peer* peer : peers_) {
        std::lock_guard<std::mutex> peer_lock(peer->mu);
        const bool expired = std::any_of(peer->queue.begin(), peer->queue.end(), [&](auto& s) {
          return s->deadline_ns != 0 && now >= s->deadline_ns;
        });
        if (expired) {
          std::deque<std::unique_ptr<Slice>> keep;
          for (auto& s : peer->queue) {
            if (s->deadline_ns != 0 && now >= s->deadline_ns) {
              EndSlice(*s, KVB_ERR_DEADLINE_EXCEEDED,
                       Fmt("deadline passed while queued for peer '%s' (%llu ms after post)",
                           peer->node_id.c_str(), U((now - s->posted_ns) / kMsNs)),
                       &done);
            } else {
              keep.push_back(std::move(s));
            }
          }
          peer->queue.swap(keep);
        }
        for (const auto& s : peer->queue) {
          if (s->deadline_ns != 0) next = std::min(next, s->deadline_ns);
        }
        MaybeSpawnLanes(*peer);
      }
    }
    RunCompletions(done);
    lock.lock();
    hk_next_wake_ns_ = std::min(hk_next_wake_ns_, next);
  }
}

}  // namespace kvbridge::tcp
