#include "socket_io.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace kvbridge::plugin {

namespace {

sdk::Status Unreachable(std::string_view label, const char* what, int err = 0) {
  std::string msg(label);
  msg += ": ";
  msg += what;
  if (err != 0) {
    msg += ": ";
    msg += std::strerror(err);
  }
  return sdk::Status(KVB_ERR_PEER_UNREACHABLE, std::move(msg));
}

// Receives between 1 and len bytes, waiting for the first until the deadline.
sdk::Result<size_t> RecvSome(const sdk::Host& host, int fd, uint8_t* p, size_t len,
                             uint64_t deadline_ns, std::string_view label) {
  for (;;) {
    const ssize_t r = recv(fd, p, len, MSG_DONTWAIT);
    if (r > 0) return static_cast<size_t>(r);
    if (r == 0) return Unreachable(label, "closed by the peer");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Unreachable(label, "recv", errno);
    if (sdk::Status st = WaitFd(host, fd, POLLIN, deadline_ns, label); !st.ok()) return st;
  }
}

}  // namespace

sdk::Status WaitFd(const sdk::Host& host, int fd, short events, uint64_t deadline_ns,
                   std::string_view label) {
  for (;;) {
    const uint64_t now = host.NowNs();
    if (now >= deadline_ns) return Unreachable(label, "timed out");
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(std::min<uint64_t>((deadline_ns - now) / 1000000 + 1, 1000));
    const int r = poll(&p, 1, ms);
    if (r > 0) return sdk::Status();
    if (r < 0 && errno != EINTR) return Unreachable(label, "poll", errno);
  }
}

sdk::Status SendAll(const sdk::Host& host, int fd, const void* data, size_t len,
                    uint64_t deadline_ns, std::string_view label) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    const ssize_t w = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      len -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (sdk::Status st = WaitFd(host, fd, POLLOUT, deadline_ns, label); !st.ok()) return st;
      continue;
    }
    return Unreachable(label, "send", errno);
  }
  return sdk::Status();
}

sdk::Status RecvAll(const sdk::Host& host, int fd, void* data, size_t len, uint64_t deadline_ns,
                    std::string_view label) {
  auto* p = static_cast<uint8_t*>(data);
  while (len > 0) {
    auto got = RecvSome(host, fd, p, len, deadline_ns, label);
    if (!got.ok()) return got.status();
    p += *got;
    len -= *got;
  }
  return sdk::Status();
}

sdk::Status CarryHandshake(const sdk::Host& host, int fd, sdk::AuthSession& session, bool client,
                           uint64_t deadline_ns, std::string_view label) {
  std::vector<uint8_t> in, out;
  bool receive = !client;
  for (;;) {
    in.clear();
    if (receive) {
      // Asks again after every partial read, so a bad magic is refused on its first bytes.
      auto need = session.Need(sdk::Bytes(in));
      while (need.ok() && *need > in.size()) {
        const size_t have = in.size();
        in.resize(*need);
        auto got = RecvSome(host, fd, in.data() + have, *need - have, deadline_ns, label);
        if (!got.ok()) return got.status();
        in.resize(have + *got);
        need = session.Need(sdk::Bytes(in));
      }
      if (!need.ok()) return need.status();
    }
    receive = true;
    const sdk::Status st = session.Step(sdk::Bytes(in), &out);
    if (!out.empty()) {
      const sdk::Status sent = SendAll(host, fd, out.data(), out.size(), deadline_ns, label);
      if (!sent.ok() && (st.ok() || st.code() == KVB_IN_PROGRESS)) return sent;
    }
    if (st.code() != KVB_IN_PROGRESS) return st;
  }
}

}  // namespace kvbridge::plugin
