// The tcp transport: requests (post, poll, cancel, slices, lanes per peer) and the housekeeper.
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
  if (op.crc_out != nullptr && code == KVB_OK) {
    if (!s.crc_taken) {
      op.crc_whole = false;
    } else if (op.slice_crcs.empty()) {
      op.crc = s.crc;
    } else {
      op.slice_crcs[s.index] = s.crc;
    }
  }
  if (++op.ended_slices == op.total_slices) {
    op.status = op.error;
    if (op.error == KVB_OK) {
      (op.opcode == KVB_OP_READ ? counters_.bytes_read : counters_.bytes_written)
          .fetch_add(op.length);
      if (op.crc_out != nullptr && op.crc_whole) {
        // The slices' CRCs, joined in order: slice k is slice_bytes long but the last.
        uint32_t crc = op.slice_crcs.empty() ? op.crc : op.slice_crcs[0];
        for (size_t k = 1; k < op.slice_crcs.size(); ++k) {
          const uint64_t len = std::min(op.slice_bytes, op.length - k * op.slice_bytes);
          crc = util::Crc32cCombine(crc, op.slice_crcs[k], len);
        }
        op.crc_out->crc32c = crc;
        op.crc_out->computed = 1;
      }
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
  if (op_size < KVB_XFER_OP_SIZE_1_0) {
    *err = Fmt("post: op_size %u is smaller than a 1.0 kvb_xfer_op_t (%u)", op_size,
               KVB_XFER_OP_SIZE_1_0);
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
  // The slot an op's checksum goes to, when the host's ops are long enough to hold one (1.4)
  // and the op asks; device memory is staged through bounce buffers and never checksummed here.
  const bool ops_have_crc = op_size >= offsetof(kvb_xfer_op_t, crc) + sizeof(kvb_op_crc_t*);
  auto crc_slot = [&](uint32_t i, int dev) -> kvb_op_crc_t* {
    const kvb_xfer_op_t& op = op_at(i);
    if (!ops_have_crc || config_.op_checksums == 0 || dev >= 0 ||
        (op.flags & KVB_XOP_CRC32C) == 0) {
      return nullptr;
    }
    return op.crc;
  };
  // Per op: the local region's device (-1: host memory) and the slice length. Slices of device
  // memory are at most one staging buffer long (tcp.staging_slice_bytes): each is copied
  // through one bounce buffer while the one before it is on the wire.
  std::vector<int> device(count, -1);
  auto cut = [&](uint32_t i) {
    return device[i] >= 0 ? std::min(config_.slice_bytes, config_.staging_slice_bytes)
                          : config_.slice_bytes;
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
      device[i] = it->second->device;
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
      nslices += prefails ? 1 : (op.length - 1) / cut(i) + 1;
    }
    const uint64_t queued_slices = peer->queued_slices.load();
    const uint64_t max_slices = config_.max_queued_slices_per_peer;
    if (queued_slices > 0 && (queued_slices > max_slices || nslices > max_slices - queued_slices)) {
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
      const uint64_t slice = cut(i);
      st.crc_out = crc_slot(i, device[i]);
      st.slice_bytes = slice;
      for (uint64_t off = 0; off < op.length; off += slice) {
        auto s = make_slice(i);
        s->local = static_cast<uint8_t*>(op.local_addr) + off;
        s->offset = op.remote_offset + off;
        s->length = std::min(slice, op.length - off);
        s->device = device[i];
        s->index = st.total_slices;
        s->want_crc = st.crc_out != nullptr;
        slices.push_back(std::move(s));
        ++st.total_slices;
      }
      if (st.crc_out != nullptr && st.total_slices > 1) st.slice_crcs.assign(st.total_slices, 0);
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
  *out = handles_.Adopt(std::move(handle));
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
  handles_.Free(h);
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
  s.device_regions_staged = counters_.device_regions_staged.load();
  s.device_bytes_staged = counters_.device_bytes_staged.load();
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
