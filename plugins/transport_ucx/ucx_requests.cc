// Issuing queued slices as RMA within the endpoint window, flushes, and UCX completions.
#include <poll.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "ucx_internal.h"
#include "ucx_worker.h"

namespace kvbridge::ucx {

// ---------------------------------------------------------------------------------------------
// Client side: issuing slices.

void Worker::Pump(Peer& peer) {
  if (peer.ep && peer.ep->error != UCS_OK) {
    const std::string msg =
        "ucx: connection to peer '" + peer.node_id + "' failed: " + UcsText(peer.ep->error);
    CloseEndpoint(peer, KVB_ERR_PEER_UNREACHABLE, msg, false);
    FailQueue(peer, KVB_ERR_PEER_UNREACHABLE, msg);
    return;
  }
  if (peer.queue.empty()) return;
  if (peer.same_host) CheckPeerExited(peer);
  if (peer.exited) {
    FailQueue(peer, KVB_ERR_PEER_UNREACHABLE,
              "ucx: peer '" + peer.node_id + "' (same host) has exited");
    return;
  }
  if (!peer.ep) {
    StartEndpoint(peer);
    return;
  }
  Endpoint& ep = *peer.ep;
  if (ep.state != Endpoint::State::kReady) return;
  if (!ep.revoking.empty()) AckRevokes(ep);
  while (!peer.queue.empty() &&
         (ep.inflight_bytes == 0 || ep.inflight_bytes < cfg_->max_inflight_bytes_per_ep)) {
    SlicePtr s = std::move(peer.queue.front());
    peer.queue.pop_front();
    if (s->ended) continue;
    if (!Issue(ep, s)) {
      peer.queue.push_front(std::move(s));  // waits for the target's grant
      break;
    }
  }
  if (!ep.unflushed.empty()) Flush(ep);
  if (!ep.revoking.empty()) AckRevokes(ep);
}

bool Worker::Issue(Endpoint& ep, const SlicePtr& s) {
  Peer& peer = *ep.peer;
  Request& req = *s->req;
  if (ep.segments_version != peer.segments_version) {
    for (auto& [seg, key] : ep.rkeys) ucp_rkey_destroy(key.rkey);
    ep.rkeys.clear();
    std::erase_if(ep.grants, [](const auto& g) { return g.second == Endpoint::Grant::kRefused; });
    ep.segments_version = peer.segments_version;
  }
  // No RMA to a segment before the target granted it on this endpoint: a segment the target
  // deregistered is refused here, and never written.
  auto grant = ep.grants.find(s->segment);
  if (grant == ep.grants.end()) {
    ep.grants[s->segment] = Endpoint::Grant::kAsked;
    // [u64 segment][u8 PEER mode][our endpoints]: where the target sends its revocation later.
    const uint64_t seg = s->segment;
    std::string msg(reinterpret_cast<const char*>(&seg), sizeof(seg));
    const std::string ours = t_->EndpointsText();
    if (sizeof(seg) + 1 + ours.size() <= kMaxGrantRequest) {
      msg.push_back(ep.peer_mode ? 1 : 0);
      msg += ours;
    }
    SendAm(ep.ep, &ep, kGrantRequest, ep.session, KVB_OK,
           reinterpret_cast<const uint8_t*>(msg.data()), static_cast<uint32_t>(msg.size()), true);
    return false;
  }
  if (grant->second == Endpoint::Grant::kAsked) return false;
  if (grant->second == Endpoint::Grant::kRefused || ep.revoking.count(s->segment) != 0) {
    t_->EndSlice(*s, KVB_ERR_NOT_REGISTERED,
                 "ucx: segment " + std::to_string(s->segment) + " is not registered at peer '" +
                     peer.node_id + "' (it refused or revoked the grant)",
                 &done_);
    return true;
  }
  auto it = ep.rkeys.find(s->segment);
  uint64_t seg_len = 0;
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    auto seg = peer.segments.find(s->segment);
    if (seg == peer.segments.end()) {
      t_->EndSlice(*s, KVB_ERR_NOT_REGISTERED,
                   "ucx: segment " + std::to_string(s->segment) + " is not registered at peer '" +
                       peer.node_id + "'",
                   &done_);
      return true;
    }
    seg_len = seg->second.length;
    if (it == ep.rkeys.end()) {
      const std::string& bytes = seg->second.rkey;
      Endpoint::Key key;
      for (int i = 0; i < 8; ++i) key.base |= uint64_t(uint8_t(bytes[i])) << (8 * i);
      const ucs_status_t st = ucp_ep_rkey_unpack(ep.ep, bytes.data() + 8, &key.rkey);
      if (st != UCS_OK) {
        t_->EndSlice(*s, KVB_ERR_PROTOCOL,
                     "ucx: the rkey of segment " + std::to_string(s->segment) + " of peer '" +
                         peer.node_id + "' does not unpack: " + UcsText(st),
                     &done_);
        return true;
      }
      it = ep.rkeys.emplace(s->segment, key).first;
    }
  }
  if (s->offset > seg_len || s->length > seg_len - s->offset) {
    t_->EndSlice(*s, KVB_ERR_OUT_OF_BOUNDS, "ucx: range outside the peer's segment", &done_);
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(req.mu);
    if (req.final) {
      s->ended = true;
      return true;
    }
    ++req.in_ucx;
  }
  const bool put = s->opcode == KVB_OP_WRITE;
  auto* rec = new Record(put ? Record::Kind::kPut : Record::Kind::kGet, this, &ep, s);
  if (ep.records.empty()) ep.last_progress_ns = t_->Now();
  if (ep.records.empty() || req.progress_timeout_ns < ep.progress_timeout_ns) {
    ep.progress_timeout_ns = req.progress_timeout_ns;
  }
  ep.records.insert(rec);
  ++records_;
  ep.inflight_bytes += s->length;
  if (put) ep.unflushed.push_back(s);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send = OnSend;
  p.user_data = rec;
  // Told, not detected: UCX would otherwise look the pointer up in its memory-type cache.
  p.memory_type = s->local_cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  const uint64_t raddr = it->second.base + s->offset;
  void* r = put ? ucp_put_nbx(ep.ep, s->local, s->length, raddr, it->second.rkey, &p)
                : ucp_get_nbx(ep.ep, s->local, s->length, raddr, it->second.rkey, &p);
  if (!UCS_PTR_IS_PTR(r)) OnDone(rec, UCS_PTR_STATUS(r));
  return true;
}

void Worker::Flush(Endpoint& ep) {
  auto* rec = new Record(Record::Kind::kFlush, this, &ep, nullptr);
  rec->flushed.swap(ep.unflushed);
  if (ep.records.empty()) ep.last_progress_ns = t_->Now();
  ep.records.insert(rec);
  ++records_;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = OnSend;
  p.user_data = rec;
  void* r = ucp_ep_flush_nbx(ep.ep, &p);
  if (!UCS_PTR_IS_PTR(r)) OnDone(rec, UCS_PTR_STATUS(r));
}

void Worker::OnSend(void* request, ucs_status_t status, void* user) {
  auto* rec = static_cast<Record*>(user);
  rec->worker->OnDone(rec, status);
  ucp_request_free(request);
}

void Worker::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  // Runs inside ucp_worker_progress; Pump acts on it.
  static_cast<Endpoint*>(arg)->error = status;
}

void Worker::OnDone(Record* rec, ucs_status_t status) {
  --records_;
  Endpoint* ep = rec->ep;
  if (ep != nullptr) {
    ep->records.erase(rec);
    ep->last_progress_ns = t_->Now();
  }
  const std::string why = status == UCS_OK
                              ? std::string()
                              : "ucx: transfer to peer '" +
                                    (ep && ep->peer ? ep->peer->node_id : std::string("?")) +
                                    "' failed: " + UcsText(status);
  switch (rec->kind) {
    case Record::Kind::kPut:
    case Record::Kind::kGet: {
      Slice& s = *rec->slice;
      if (ep != nullptr) ep->inflight_bytes -= s.length;
      if (!rec->detached) {
        std::lock_guard<std::mutex> lock(s.req->mu);
        if (--s.req->in_ucx == 0) s.req->cv.notify_all();
      }
      if (status != UCS_OK) {
        t_->EndSlice(s, KVB_ERR_PEER_UNREACHABLE, why, &done_);
      } else if (rec->kind == Record::Kind::kGet) {
        t_->EndSlice(s, KVB_OK, "", &done_);
      }  // a put ends with the flush that follows it
      break;
    }
    case Record::Kind::kFlush:
      for (auto& s : rec->flushed) {
        t_->EndSlice(*s, status == UCS_OK ? KVB_OK : KVB_ERR_PEER_UNREACHABLE, why, &done_);
      }
      break;
    case Record::Kind::kAm:
      if (status != UCS_OK && ep != nullptr && ep->state == Endpoint::State::kHello) {
        ep->error = status;
      }
      break;
  }
  delete rec;
}

}  // namespace kvbridge::ucx
