// The tcp transport: Lane, one outbound connection to one peer incarnation (tcp_internal.h).
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
#include "util/checksum.h"
#include "util/host_port.h"

namespace kvbridge::tcp {

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
    PollCopies(now, &done);
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
        FreeStaging(e);
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
    StageWrites(&done);
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
    // Device copies are polled, not waited on: look again within a millisecond while any runs.
    if (CopiesRunning()) wait_ns = std::min(wait_ns, kMsNs);
    const int timeout_ms = static_cast<int>((wait_ns + kMsNs - 1) / kMsNs);
    // A device WRITE is sent once its bytes are staged; a READ payload waiting for a bounce
    // buffer is left in the socket until a copy frees one.
    bool sendable = send_idx_ < inflight_.size();
    if (sendable) {
      const Entry& e = inflight_[send_idx_];
      sendable =
          e.s->device < 0 || e.s->opcode != KVB_OP_WRITE || e.abandoned ||
          (e.staging >= 0 && dev_->buffers()[e.staging].state == StagingBuffer::State::kFilled);
    }
    const bool no_buffer = wait_buffer_ && dev_ != nullptr && !dev_->HasFree();
    const short events = (no_buffer ? 0 : POLLIN) | (sendable ? POLLOUT : 0);
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
    // A device WRITE's payload is our bounce buffer, not user memory: sent once filled.
    const bool staged = write && e.s->device >= 0;
    if (staged) {
      if (e.abandoned) break;  // dealt with at the top of the next loop
      if (e.staging < 0 || dev_->buffers()[e.staging].state != StagingBuffer::State::kFilled) {
        break;
      }
    } else if (write) {
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
      uint8_t* payload = staged ? dev_->buffers()[e.staging].p : e.s->local;
      iov[n++] = {payload + done, e.s->length - done};
    }
  }
  if (n == 0) return true;
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = static_cast<size_t>(n);
  const ssize_t w = sendmsg(fd_, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
  const int err = errno;
  if (w < 0) {
    for (int k = 0; k < ne; ++k) ExitUserMem(*entered[k]);
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) return true;
    *out = {Exit::kFail, KVB_ERR_PEER_UNREACHABLE,
            Fmt("send to %s: %s", Name().c_str(), ErrnoText(err).c_str())};
    return false;
  }
  if (w > 0) last_progress_ns_ = now;
  uint64_t left = static_cast<uint64_t>(w);
  constexpr uint64_t kHdr = wire::kRequestHeaderBytes;
  while (left > 0) {
    Entry& e = inflight_[send_idx_];
    const uint64_t take = std::min(left, e.frame_bytes() - e.sent);
    // A WRITE that wants its checksum folds in the payload bytes this call sent, which the
    // kernel has just read (so they are in cache), while the caller's memory is still ours.
    if (e.s->want_crc && e.s->device < 0 && e.sent + take > kHdr) {
      const uint64_t from = std::max(e.sent, kHdr) - kHdr;
      e.crc = util::Crc32c(e.s->local + from, e.sent + take - kHdr - from, e.crc);
    }
    e.sent += take;
    left -= take;
    if (e.sent == e.frame_bytes()) {
      FreeStaging(e);  // a WRITE's bounce buffer is free once its bytes are in the socket
      ++send_idx_;
    }
  }
  for (int k = 0; k < ne; ++k) ExitUserMem(*entered[k]);
  return true;
}

void Lane::CompleteFront(kvb_status_t code, const std::string& msg, Completions* done) {
  Entry& e = inflight_.front();
  // Every byte of a READ went to the caller's memory, or every byte of a WRITE came from it,
  // through the CRC in RecvSome/SendSome, unless some went to scratch (then the slice already
  // ended or its request is final).
  if (code == KVB_OK && e.s->want_crc && !e.abandoned) {
    e.s->crc = e.crc;
    e.s->crc_taken = true;
  }
  FreeStaging(e);
  t_->EndSlice(*e.s, code, msg, done);
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
  wait_buffer_ = false;
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
        case KVB_ERR_IO:
          msg =
              Fmt("peer '%s' could not copy [%llu, +%llu) of its device segment %llu through "
                  "staging (a failed device copy; its log names the CUDA error)",
                  peer_->node_id.c_str(), U(e.s->offset), U(e.s->length), U(e.s->segment));
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
    // A device READ's payload lands in a bounce buffer, then one copy takes it to the device.
    const bool staged = e.s->device >= 0;
    if (staged && e.staging < 0 && !e.abandoned) {
      if (!StagingReady(*e.s, done)) {
        e.abandoned = true;  // ended with the staging error; the payload is drained
      } else {
        const int b = dev_->TakeFree(StagingBuffer::State::kReceiving);
        if (b < 0) {
          wait_buffer_ = true;  // every buffer is under a copy; one frees soon
          return true;
        }
        e.staging = b;
      }
    }
    const bool into_staging = staged && e.staging >= 0;
    const bool user = !staged && !e.abandoned && EnterUserMem(*e.s);
    iovec v[2];
    if (into_staging) {
      v[0] = {dev_->buffers()[e.staging].p + payload_got_, static_cast<size_t>(want)};
    } else if (user) {
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
    // The checksum of what just landed, while it is in this core's cache and before the
    // request may end (the caller's memory is ours only until ExitUserMem).
    if (user && r > 0 && e.s->want_crc) {
      e.crc = util::Crc32c(v[0].iov_base, std::min<size_t>(static_cast<size_t>(r), v[0].iov_len),
                           e.crc);
    }
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
      if (into_staging) {
        FinishStagedRead(done);
      } else {
        CompleteFront(KVB_OK, "", done);
      }
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
  DrainCopies(&done);  // before any slice is requeued or ended: no copy outlives the lane
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
// Device slices: staging through pinned bounce buffers (tcp_staging.h, README.md "Device memory").
// WRITE: the entries next in line get a buffer and a device -> pinned copy each (up to all but
// one buffer, so a READ payload always finds one eventually), and are sent once their copy is
// answered, so slice k+1 is copied while slice k is on the wire. READ: the payload is received
// into a buffer, then a pinned -> device copy runs while the next payload is received; the
// slice ends when that copy is answered. A copy holds its request's in_user_mem, so cancel
// returns only once no copy touches the request's memory.

bool Lane::StagingReady(Slice& s, Completions* done) {
  if (!dev_) {
    dev_ = std::make_unique<DevStaging>(t_, t_->config().staging_slice_bytes,
                                        t_->config().staging_buffers);
  }
  std::string why;
  const kvb_status_t st = dev_->Init(&why);
  if (st == KVB_OK) return true;
  t_->EndSlice(s, st, why, done);
  return false;
}

void Lane::StageWrites(Completions* done) {
  for (size_t i = send_idx_; i < inflight_.size(); ++i) {
    Entry& e = inflight_[i];
    if (e.s->device < 0 || e.s->opcode != KVB_OP_WRITE || e.staging >= 0 || e.abandoned ||
        e.sent > 0) {
      continue;
    }
    if (!StagingReady(*e.s, done)) {
      e.abandoned = true;
      continue;
    }
    if (write_buffers_ + 1 >= dev_->buffers().size()) return;  // one stays for READ payloads
    const int b = dev_->TakeFree(StagingBuffer::State::kCopyIn);
    if (b < 0) return;
    StagingBuffer& buf = dev_->buffers()[b];
    std::string why;
    kvb_dev_stream_t* stream = nullptr;
    kvb_status_t st = dev_->StreamFor(e.s->device, &stream, &why);
    if (st == KVB_OK) {
      if (!EnterUserMem(*e.s)) {  // the request went final meanwhile
        buf.state = StagingBuffer::State::kFree;
        e.abandoned = true;
        continue;
      }
      st = dev_->Copy(stream, buf.p, e.s->local, e.s->length, &buf.ticket, &why);
      if (st != KVB_OK) ExitUserMem(*e.s);
    }
    if (st != KVB_OK) {
      buf.state = StagingBuffer::State::kFree;
      t_->EndSlice(*e.s, st,
                   Fmt("device -> staging copy of %llu bytes for a WRITE to %s: %s", U(e.s->length),
                       Name().c_str(), why.c_str()),
                   done);
      e.abandoned = true;
      continue;
    }
    buf.stream = stream;
    buf.req = e.s->req;
    buf.entry_id = e.id;
    e.staging = b;
    ++write_buffers_;
  }
}

bool Lane::CopiesRunning() const {
  if (!dev_) return false;
  for (const auto& b : dev_->buffers()) {
    if (b.state == StagingBuffer::State::kCopyIn || b.state == StagingBuffer::State::kCopyOut) {
      return true;
    }
  }
  return false;
}

void Lane::EndCopyOut(StagingBuffer& b, kvb_status_t st, const std::string& why,
                      Completions* done) {
  t_->EndSlice(*b.read_slice, st,
               st == KVB_OK ? std::string()
                            : Fmt("staging -> device copy of %llu bytes for a READ from %s: %s",
                                  U(b.read_slice->length), Name().c_str(), why.c_str()),
               done);
  b.read_slice.reset();
}

void Lane::PollCopies(uint64_t now, Completions* done) {
  if (!dev_) return;
  for (auto& b : dev_->buffers()) {
    if (b.state != StagingBuffer::State::kCopyIn && b.state != StagingBuffer::State::kCopyOut) {
      continue;
    }
    std::string why;
    const kvb_status_t st = dev_->Done(b.stream, b.ticket, &why);
    if (st == KVB_IN_PROGRESS) continue;
    last_progress_ns_ = now;  // a finished copy is progress, like a byte on the wire
    ExitUserMem(*b.req);
    b.req.reset();
    if (b.state == StagingBuffer::State::kCopyOut) {
      EndCopyOut(b, st, why, done);
      b.state = StagingBuffer::State::kFree;
      continue;
    }
    Entry* e = nullptr;
    for (auto& x : inflight_) {
      if (b.entry_id != 0 && x.id == b.entry_id) e = &x;
    }
    if (st == KVB_OK && e != nullptr && !e->abandoned) {
      b.state = StagingBuffer::State::kFilled;
      continue;
    }
    if (e != nullptr) {
      if (st != KVB_OK) {
        t_->EndSlice(*e->s, st,
                     Fmt("device -> staging copy of %llu bytes for a WRITE to %s: %s",
                         U(e->s->length), Name().c_str(), why.c_str()),
                     done);
      }
      e->abandoned = true;
      e->staging = -1;
    }
    b.entry_id = 0;
    b.state = StagingBuffer::State::kFree;
    --write_buffers_;
  }
}

void Lane::FreeStaging(Entry& e) {
  if (e.staging < 0 || !dev_) return;
  StagingBuffer& b = dev_->buffers()[e.staging];
  e.staging = -1;
  if (b.state == StagingBuffer::State::kCopyIn) {
    b.entry_id = 0;  // orphaned: freed when its copy is answered (PollCopies)
    return;
  }
  if (b.state == StagingBuffer::State::kFilled) --write_buffers_;
  b.entry_id = 0;
  b.state = StagingBuffer::State::kFree;
}

void Lane::FinishStagedRead(Completions* done) {
  Entry& e = inflight_.front();
  StagingBuffer& b = dev_->buffers()[e.staging];
  if (e.abandoned || !EnterUserMem(*e.s)) {
    CompleteFront(KVB_OK, "", done);  // ended or final already: this changes nothing
    return;
  }
  std::string why;
  kvb_dev_stream_t* stream = nullptr;
  kvb_status_t st = dev_->StreamFor(e.s->device, &stream, &why);
  if (st == KVB_OK) st = dev_->Copy(stream, e.s->local, b.p, e.s->length, &b.ticket, &why);
  if (st != KVB_OK) {
    ExitUserMem(*e.s);
    CompleteFront(st,
                  Fmt("staging -> device copy of %llu bytes for a READ from %s: %s", U(e.s->length),
                      Name().c_str(), why.c_str()),
                  done);
    return;
  }
  e.staging = -1;
  b.state = StagingBuffer::State::kCopyOut;
  b.stream = stream;
  b.req = e.s->req;
  b.read_slice = std::move(e.s);
  inflight_.pop_front();
  --send_idx_;
  inflight_count.store(static_cast<uint32_t>(inflight_.size()));
}

void Lane::DrainCopies(Completions* done) {
  if (!dev_) return;
  for (auto& b : dev_->buffers()) {
    if (b.state != StagingBuffer::State::kCopyIn && b.state != StagingBuffer::State::kCopyOut) {
      continue;
    }
    std::string why;
    const kvb_status_t st = dev_->Wait(b.stream, b.ticket, &why);
    ExitUserMem(*b.req);
    b.req.reset();
    if (b.state == StagingBuffer::State::kCopyOut) {
      EndCopyOut(b, st, why, done);
    }
    b.state = StagingBuffer::State::kFree;
  }
  for (auto& e : inflight_) e.staging = -1;
  write_buffers_ = 0;
  dev_.reset();
}

}  // namespace kvbridge::tcp
