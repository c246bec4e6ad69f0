// The tcp transport: server side (accept loop, inbound handshake, serving requests).
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
    const uint64_t ns = static_cast<uint64_t>(
        static_cast<double>(n) * 1e9 / static_cast<double>(config_.min_inbound_bytes_per_sec));
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
  // Device regions (README.md "Device memory"): bytes pass through this connection's pinned
  // bounce buffers. A WRITE is received a buffer at a time, each buffer's pinned -> device copy
  // running while the next one is received; a READ is copied device -> pinned in one go and
  // answered once that copy is done, so a failed copy is a named IO error, never a cut stream.
  // No buffer is reused or freed under a running copy (DevStaging waits for it).
  std::unique_ptr<DevStaging> dev;
  auto dev_ready = [&](int device, kvb_dev_stream_t** stream, std::string* why) {
    if (!dev) {
      dev =
          std::make_unique<DevStaging>(this, config_.staging_slice_bytes, config_.staging_buffers);
    }
    const kvb_status_t st = dev->Init(why);
    return st != KVB_OK ? st : dev->StreamFor(device, stream, why);
  };
  auto log_copy_failure = [&](const char* what, const wire::RequestHeader& h,
                              const std::string& why) {
    Log(KVB_LOG_WARN, "inbound %s: %s of %llu bytes at offset %llu of device segment %llu: %s",
        addr.c_str(), what, U(h.length), U(h.offset), U(h.segment_id), why.c_str());
  };
  // WRITE into a device region; *status is the response's (OK, or the copy's error).
  auto write_device = [&](const std::shared_ptr<Region>& region, const wire::RequestHeader& h,
                          kvb_status_t* status) -> Io {
    std::string why;
    kvb_dev_stream_t* stream = nullptr;
    *status = dev_ready(region->device, &stream, &why);
    if (*status != KVB_OK) {
      log_copy_failure("staging a WRITE", h, why);
      return recv_payload(nullptr, h.length);
    }
    auto& bufs = dev->buffers();
    const uint64_t chunk = dev->buffer_bytes();
    size_t next = 0;
    Io io = Io::kOk;
    uint64_t off = 0;
    for (; off < h.length && io == Io::kOk && *status == KVB_OK; off += chunk) {
      StagingBuffer& b = bufs[next];
      next = (next + 1) % bufs.size();
      if (b.state == StagingBuffer::State::kCopyOut) {  // its previous copy must be done first
        b.state = StagingBuffer::State::kFree;
        *status = dev->Wait(b.stream, b.ticket, &why);
        if (*status != KVB_OK) break;
      }
      const uint64_t len = std::min(chunk, h.length - off);
      io = recv_payload(b.p, len);
      if (io != Io::kOk) break;
      *status = dev->Copy(stream, region->base + h.offset + off, b.p, len, &b.ticket, &why);
      if (*status == KVB_OK) {
        b.state = StagingBuffer::State::kCopyOut;
        b.stream = stream;
      }
    }
    for (auto& b : bufs) {  // every copy answered before the region is let go
      if (b.state != StagingBuffer::State::kCopyOut) continue;
      b.state = StagingBuffer::State::kFree;
      std::string w;
      const kvb_status_t st = dev->Wait(b.stream, b.ticket, &w);
      if (st != KVB_OK && *status == KVB_OK) {
        *status = st;
        why = w;
      }
    }
    if (*status != KVB_OK) {
      log_copy_failure("a WRITE through staging", h, why);
      if (io == Io::kOk && off < h.length) io = recv_payload(nullptr, h.length - off);
    }
    return io;
  };
  // READ from a device region: the payload staged whole (one copy) before the response.
  auto read_device = [&](const std::shared_ptr<Region>& region, const wire::RequestHeader& h,
                         kvb_status_t* status) -> uint8_t* {
    std::string why;
    kvb_dev_stream_t* stream = nullptr;
    uint8_t* buf = nullptr;
    uint64_t ticket = 0;
    *status = dev_ready(region->device, &stream, &why);
    if (*status == KVB_OK) *status = dev->Scratch(h.length, &buf, &why);
    if (*status == KVB_OK) {
      *status = dev->Copy(stream, buf, region->base + h.offset, h.length, &ticket, &why);
    }
    if (*status == KVB_OK) *status = dev->Wait(stream, ticket, &why);
    if (*status == KVB_OK) return buf;
    log_copy_failure("a READ through staging", h, why);
    return nullptr;
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
    } else if (region->device >= 0 && h.opcode == KVB_OP_READ) {
      // Responses before this one go out first: the staging buffer is one per connection.
      io = flush();
      kvb_status_t st = KVB_OK;
      uint8_t* payload = io == Io::kOk ? read_device(region, h, &st) : nullptr;
      ReleaseRegion(region, fd);
      if (io == Io::kOk) {
        resp.status = st == KVB_OK ? KVB_OK : KVB_ERR_IO;
        resp.length = st == KVB_OK ? h.length : 0;
        io = queue(resp, st == KVB_OK ? payload : nullptr, nullptr);
        if (io == Io::kOk) io = flush();
      }
    } else if (region->device >= 0) {
      kvb_status_t st = KVB_OK;
      io = write_device(region, h, &st);
      ReleaseRegion(region, fd);
      resp.status = st == KVB_OK ? KVB_OK : KVB_ERR_IO;
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

}  // namespace kvbridge::tcp
