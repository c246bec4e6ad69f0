// The tcp transport: socket helpers, the handshake loop, config, log limiter, token bucket.
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

#include "tcp_internal.h"
#include "util/host_port.h"

namespace kvbridge::tcp {

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
           const std::function<Io()>& before_wait) {
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

// Runs the host's peer handshake (ABI 1.2 auth services) on a connected socket: the host makes
// and judges the messages, this only carries them. A client steps first with no input.
HandshakeResult RunHandshake(const Transport& t, int fd, int32_t role,
                             const std::string& expect_node, uint64_t expect_incarnation,
                             const Limits& lim) {
  const kvb_host_services_t* h = t.host();
  char why[512] = {0};
  kvb_auth_t* a = nullptr;
  kvb_status_t st = h->auth_begin(h->host_ctx, "tcp", role,
                                  role == KVB_AUTH_CLIENT ? expect_node.c_str() : nullptr,
                                  expect_incarnation, &a, why, sizeof(why));
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
    st = h->auth_step(h->host_ctx, a, receive ? in : nullptr, have, out, sizeof(out), &out_len, why,
                      sizeof(why));
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
      read("tcp.max_frame_bytes", 1, 1ull << 32, &c.max_frame_bytes) &&
      read("tcp.staging_slice_bytes", 4096, 1ull << 30, &c.staging_slice_bytes) &&
      read("tcp.staging_buffers", 2, 64, &c.staging_buffers) &&
      read("tcp.op_checksums", 0, 1, &c.op_checksums);
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

}  // namespace kvbridge::tcp
