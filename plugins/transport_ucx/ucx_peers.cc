// Endpoints and the peer-facing protocol: endpoint life (creation, close, liveness), the
// hello on both sides, grants and revocations.
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ucx_internal.h"
#include "ucx_worker.h"

namespace kvbridge::ucx {

// ---------------------------------------------------------------------------------------------
// Peers.

void Worker::AddPeer(Peer* peer) {
  peers_.insert(peer);
  if (peer->pidfd >= 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = peer;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, peer->pidfd, &ev);
  }
}

void Worker::CheckPeerExited(Peer& peer) {
  if (peer.exited || peer.pidfd < 0) return;
  pollfd pfd{peer.pidfd, POLLIN, 0};
  if (poll(&pfd, 1, 0) <= 0) return;
  peer.exited = true;
  epoll_ctl(epfd_, EPOLL_CTL_DEL, peer.pidfd, nullptr);
  const std::string msg = "ucx: peer '" + peer.node_id + "' (pid " +
                          std::to_string(peer.address.pid) + ", same host) has exited";
  t_->Log(KVB_LOG_INFO, msg);
  if (peer.ep) {
    DetachRecords(*peer.ep);
    CloseEndpoint(peer, KVB_ERR_PEER_UNREACHABLE, msg, false);
  }
  FailQueue(peer, KVB_ERR_PEER_UNREACHABLE, msg);
}

void Worker::DetachRecords(Endpoint& ep) {
  // UCX 1.13 may never complete NONE-mode RMA to a process that is gone. With the process
  // gone, nothing can land in our memory any more (a get's bytes come from it) and a put only
  // reads ours, so requests and deregistration stop waiting for these operations.
  for (Record* r : ep.records) {
    if (!r->slice || r->detached) continue;
    r->detached = true;
    std::lock_guard<std::mutex> lock(r->slice->req->mu);
    if (--r->slice->req->in_ucx == 0) r->slice->req->cv.notify_all();
  }
}

void Worker::DestroyEndpoint(std::unique_ptr<Endpoint>& ep) {
  if (ep->pidfd >= 0) close(ep->pidfd);
  ep.reset();
}

std::vector<std::shared_ptr<Request>> Worker::RemovePeer(Peer* peer) {
  std::vector<std::shared_ptr<Request>> reqs;
  auto collect = [&](const SlicePtr& s) {
    if (s && std::find(reqs.begin(), reqs.end(), s->req) == reqs.end()) reqs.push_back(s->req);
  };
  for (auto& s : peer->queue) collect(s);
  if (peer->ep) {
    for (Record* r : peer->ep->records) {
      collect(r->slice);
      for (auto& s : r->flushed) collect(s);
    }
    for (auto& s : peer->ep->unflushed) collect(s);
  }
  for (auto& r : reqs) t_->FailRequest(*r, KVB_ERR_CANCELLED, "cancelled: peer removed", &done_);
  peer->queue.clear();
  if (peer->ep) CloseEndpoint(*peer, KVB_ERR_CANCELLED, "peer removed", false, true);
  if (peer->pidfd >= 0 && !peer->exited) epoll_ctl(epfd_, EPOLL_CTL_DEL, peer->pidfd, nullptr);
  peers_.erase(peer);
  return reqs;
}

int Worker::Readdress(Peer* peer, PeerAddress address, bool same_host, int pidfd, bool exited) {
  if (peer->ep) CloseEndpoint(*peer, KVB_ERR_PEER_UNREACHABLE, "peer moved", true);
  if (peer->pidfd >= 0 && !peer->exited) epoll_ctl(epfd_, EPOLL_CTL_DEL, peer->pidfd, nullptr);
  const int old = peer->pidfd;
  peer->address = std::move(address);
  peer->same_host = same_host;
  peer->pidfd = pidfd;
  peer->exited = exited;
  if (pidfd >= 0 && !exited) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = peer;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, pidfd, &ev);
  }
  return old;
}

void Worker::Enqueue(Peer* peer, std::vector<SlicePtr> slices, std::vector<Prefailed> prefailed) {
  for (auto& p : prefailed) t_->EndSlice(*p.slice, p.code, p.msg, &done_);
  if (slices.empty()) return;
  const auto& req = slices.front()->req;
  if (req->deadline_ns != 0) deadlines_.push(DeadlineEntry{req->deadline_ns, req, peer});
  for (auto& s : slices) peer->queue.push_back(std::move(s));
}

void Worker::Abort(const std::shared_ptr<Request>& req) {
  Peer* peer = req->target;
  if (peer == nullptr || peers_.count(peer) == 0) return;
  std::erase_if(peer->queue, [&](const SlicePtr& s) { return s->req == req; });
  bool in_ucx;
  {
    std::lock_guard<std::mutex> lock(req->mu);
    in_ucx = req->in_ucx > 0;
  }
  // RMA cannot be cancelled. A NONE-mode endpoint may not be force-closed; its issued slices
  // finish on their own. A PEER-mode endpoint whose peer is moving bytes gets up to
  // ucx.cancel_drain_ms for the request's operations to finish (DrainTimers): UCX's software
  // RMA (tcp) aborts a target process whose reply to a GET, or completion of a PUT, fails to
  // send, which a force close in mid-reply causes. Otherwise, or past that, the endpoint is
  // force-closed (UCX then completes its operations CANCELED, and other requests' slices go
  // back to the queue).
  if (!in_ucx || !peer->ep || !peer->ep->peer_mode) return;
  Endpoint& ep = *peer->ep;
  const uint64_t now = t_->Now();
  const uint64_t window = uint64_t(cfg_->cancel_drain_ms) * 1'000'000ull;
  if (window > 0 && ep.state == Endpoint::State::kReady && ep.error == UCS_OK &&
      now - ep.last_progress_ns < window) {
    if (ep.draining.empty()) ep.drain_until_ns = now + window;
    ep.draining.push_back(req);
    return;
  }
  CloseEndpoint(*peer, KVB_ERR_CANCELLED, "cancelled", true);
}

void Worker::DrainTimers(uint64_t now) {
  for (Peer* p : peers_) {
    if (!p->ep || p->ep->draining.empty()) continue;
    Endpoint& ep = *p->ep;
    std::erase_if(ep.draining, [](const std::shared_ptr<Request>& r) {
      std::lock_guard<std::mutex> lock(r->mu);
      return r->in_ucx == 0;
    });
    if (ep.draining.empty() || now < ep.drain_until_ns) continue;
    t_->Log(KVB_LOG_INFO, "ucx: cancelled RMA to peer '" + p->node_id + "' did not finish within " +
                              std::to_string(cfg_->cancel_drain_ms) +
                              " ms (ucx.cancel_drain_ms); endpoint force-closed");
    CloseEndpoint(*p, KVB_ERR_CANCELLED, "cancelled", true);
  }
}

void Worker::FailQueue(Peer& peer, kvb_status_t code, const std::string& msg) {
  std::deque<SlicePtr> q;
  q.swap(peer.queue);
  for (auto& s : q) t_->EndSlice(*s, code, msg, &done_);
}

void Worker::CloseEndpoint(Peer& peer, kvb_status_t code, const std::string& msg, bool requeue,
                           bool gentle) {
  gentle = gentle && peer.ep->peer_mode && peer.ep->state == Endpoint::State::kReady &&
           peer.ep->error == UCS_OK && cfg_->cancel_drain_ms > 0;
  // The peer's UCX owes completions for the puts issued: ask for them before the close.
  if (gentle && !peer.ep->unflushed.empty()) Flush(*peer.ep);
  std::unique_ptr<Endpoint> ep = std::move(peer.ep);
  if (gentle) ep->force_at_ns = t_->Now() + uint64_t(cfg_->cancel_drain_ms) * 1'000'000ull;
  std::vector<SlicePtr> held;
  for (Record* r : ep->records) {
    if (r->slice) held.push_back(r->slice);
    for (auto& s : r->flushed) held.push_back(s);
  }
  for (auto& s : ep->unflushed) held.push_back(s);
  ep->unflushed.clear();
  std::vector<SlicePtr> back;
  for (auto& s : held) {
    if (s->ended) continue;
    bool final;
    {
      std::lock_guard<std::mutex> lock(s->req->mu);
      final = s->req->final;
    }
    if (final) {
      s->ended = true;
    } else if (requeue) {
      // RMA is idempotent: a fresh copy goes to a new endpoint; the old one is retired.
      auto copy = std::make_shared<Slice>(*s);
      s->ended = true;
      copy->ended = false;
      back.push_back(std::move(copy));
    } else {
      t_->EndSlice(*s, code, msg, &done_);
    }
  }
  for (auto it = back.rbegin(); it != back.rend(); ++it) peer.queue.push_front(*it);
  for (auto& [seg, key] : ep->rkeys) ucp_rkey_destroy(key.rkey);
  ep->rkeys.clear();
  if (ep->auth != nullptr) {
    t_->host()->auth_end(t_->host()->host_ctx, ep->auth);
    ep->auth = nullptr;
  }
  sessions_.erase(ep->session);
  if (ep->state == Endpoint::State::kHello) --hellos_;
  ep->peer = nullptr;
  t_->counters().connections_open.fetch_sub(1);
  if (code != KVB_OK && code != KVB_ERR_CANCELLED) t_->counters().connections_evicted.fetch_add(1);
  // PEER mode: force close; UCX completes the endpoint's operations (CANCELED) and stops
  // touching memory. NONE mode: never force-closed (undefined there); ReapClosing closes it
  // once idle.
  Retire(std::move(ep));
}

bool Worker::ClosingIdle() const {
  for (const auto& ep : closing_) {
    if (!ep->records.empty() && !ep->close_started) return false;
  }
  return true;
}

void Worker::ReapClosing() {
  const uint64_t now = t_->Now();
  for (auto it = closing_.begin(); it != closing_.end();) {
    Endpoint& ep = **it;
    // A gently closed PEER-mode endpoint: force-closed once idle, or when its time is up.
    const bool force_due = ep.peer_mode && (ep.records.empty() || ep.error != UCS_OK ||
                                            (ep.force_at_ns != 0 && now >= ep.force_at_ns));
    if (!ep.close_started && (ep.records.empty() || force_due)) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = ep.peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* r = ucp_ep_close_nbx(ep.ep, &p);
      ep.close_started = true;
      if (UCS_PTR_IS_PTR(r)) ep.close_req = r;
    }
    if (ep.close_req != nullptr && ucp_request_check_status(ep.close_req) != UCS_INPROGRESS) {
      ucp_request_free(ep.close_req);
      ep.close_req = nullptr;
    }
    if (!ep.records.empty() && ep.pidfd >= 0) {
      pollfd pfd{ep.pidfd, POLLIN, 0};
      if (poll(&pfd, 1, 0) > 0) DetachRecords(ep);
    }
    if (ep.close_started && ep.close_req == nullptr && ep.records.empty()) {
      DestroyEndpoint(*it);
      it = closing_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Worker::StartEndpoint(Peer& peer) {
  const kvb_host_services_t* h = t_->host();
  auto ep = std::make_unique<Endpoint>();
  ep->peer = &peer;
  ep->peer_mode = !peer.same_host;
  if (!ep->peer_mode && peer.pidfd >= 0) ep->pidfd = dup(peer.pidfd);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer.address.worker_address.data());
  ep_params.err_mode = ep->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (ep->peer_mode) {
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.err_handler.cb = OnEpError;
    ep_params.err_handler.arg = ep.get();
  }
  ucs_status_t st = ucp_ep_create(worker_, &ep_params, &ep->ep);
  if (st != UCS_OK) {
    FailQueue(peer, KVB_ERR_PEER_UNREACHABLE,
              "ucx: cannot create an endpoint to peer '" + peer.node_id + "': " + UcsText(st));
    return false;
  }
  char err[256] = "";
  const kvb_status_t ast = h->auth_begin(h->host_ctx, "ucx", KVB_AUTH_CLIENT, peer.node_id.c_str(),
                                         peer.incarnation, &ep->auth, err, sizeof(err));
  t_->counters().connections_opened.fetch_add(1);
  t_->counters().connections_open.fetch_add(1);
  ep->session = ++next_session_;
  ep->hello_deadline_ns = t_->Now() + uint64_t(cfg_->connect_timeout_ms) * 1'000'000ull;
  Endpoint* raw = ep.get();
  peer.ep = std::move(ep);
  if (ast != KVB_OK) {
    raw->auth = nullptr;
    const std::string msg = std::string("ucx: hello to '") + peer.node_id + "': " + err;
    CloseEndpoint(peer, ast, msg, false);
    FailQueue(peer, ast, msg);
    return false;
  }
  sessions_[raw->session] = raw;
  ++hellos_;
  HelloStep(*raw, nullptr, 0, KVB_IN_PROGRESS);
  return true;
}

void Worker::HelloStep(Endpoint& ep, const uint8_t* in, uint32_t in_len,
                       kvb_status_t remote_status) {
  if (ep.state != Endpoint::State::kHello || ep.peer == nullptr) return;
  Peer& peer = *ep.peer;
  const kvb_host_services_t* h = t_->host();
  uint8_t out[KVB_AUTH_MAX_MESSAGE];
  uint32_t out_len = 0;
  char err[256] = "";
  kvb_status_t st = KVB_OK;
  if (in != nullptr && h->auth_need(h->host_ctx, ep.auth, in, in_len) != int32_t(in_len)) {
    st = KVB_ERR_PROTOCOL;
    kvb_copy_message(err, sizeof(err), "malformed hello message");
  } else {
    st = h->auth_step(h->host_ctx, ep.auth, in, in_len, out, sizeof(out), &out_len, err,
                      sizeof(err));
  }
  if ((st == KVB_OK || st == KVB_IN_PROGRESS) && remote_status != KVB_OK &&
      remote_status != KVB_IN_PROGRESS) {
    // The server refused without a message our side could judge (e.g. too many handshakes).
    st = remote_status;
    kvb_copy_message(err, sizeof(err),
                     remote_status == KVB_ERR_BACKPRESSURE ? "the peer has too many hellos open"
                                                           : "the peer refused the hello");
  }
  if (st == KVB_IN_PROGRESS || st == KVB_OK) {
    if (out_len > 0 && !SendAm(ep.ep, &ep, kHelloToServer, ep.session, st, out, out_len, true)) {
      st = KVB_ERR_PEER_UNREACHABLE;
      kvb_copy_message(err, sizeof(err), "cannot send the hello");
    }
  }
  if (st == KVB_IN_PROGRESS) return;
  if (st == KVB_OK) {
    h->auth_end(h->host_ctx, ep.auth);
    ep.auth = nullptr;
    --hellos_;
    ep.state = Endpoint::State::kReady;
    ep.segments_version = ~0ull;
    return;
  }
  const std::string msg = "ucx: hello to peer '" + peer.node_id + "' failed: " + err;
  t_->Log(KVB_LOG_WARN, msg);
  CloseEndpoint(peer, st, msg, false);
  FailQueue(peer, st, msg);
}

bool Worker::SendAm(ucp_ep_h ep, Endpoint* owner, uint32_t kind, uint64_t session,
                    kvb_status_t status, const uint8_t* data, uint32_t len, bool reply_flag) {
  auto* rec = new Record(Record::Kind::kAm, this, owner, nullptr);
  rec->header = HelloHeader{session, status, kind};
  rec->data.assign(reinterpret_cast<const char*>(data), len);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = OnSend;
  p.user_data = rec;
  p.flags = reply_flag ? UCP_AM_SEND_FLAG_REPLY : 0;
  ++records_;
  if (owner != nullptr) owner->records.insert(rec);
  void* r = ucp_am_send_nbx(ep, kAmId, &rec->header, sizeof(rec->header), rec->data.data(),
                            rec->data.size(), &p);
  if (UCS_PTR_IS_PTR(r)) return true;
  const ucs_status_t st = UCS_PTR_STATUS(r);
  OnDone(rec, st);
  return st == UCS_OK;
}

// ---------------------------------------------------------------------------------------------
// Server side: hellos.

ucs_status_t Worker::OnAm(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param) {
  auto* w = static_cast<Worker*>(arg);
  HelloHeader h;
  if (header_length == sizeof(h)) std::memcpy(&h, header, sizeof(h));
  if (header_length != sizeof(h) ||
      length > (h.kind == kGrantRequest ? kMaxGrantRequest : KVB_AUTH_MAX_MESSAGE) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    w->t_->counters().frames_rejected.fetch_add(1);
    w->t_->Log(KVB_LOG_WARN, "ucx: dropped a malformed hello message");
    return UCS_OK;
  }
  ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  if (h.kind == kHelloToServer && reply == nullptr) {
    w->t_->counters().frames_rejected.fetch_add(1);
    return UCS_OK;
  }
  // Handled after progress returns: sending from inside a UCX callback is avoided.
  w->am_in_.push_back(AmMessage{h.kind, reply, h.session, h.status,
                                std::string(static_cast<const char*>(data), length)});
  return UCS_OK;
}

void Worker::ServeHello(ucp_ep_h reply_ep, uint64_t session, const std::string& msg) {
  const kvb_host_services_t* h = t_->host();
  const auto key = std::make_pair(reinterpret_cast<uintptr_t>(reply_ep), session);
  auto it = inbound_.find(key);
  if (it == inbound_.end()) {
    if (inbound_.size() >= cfg_->max_handshakes) {
      t_->counters().frames_rejected.fetch_add(1);
      SendAm(reply_ep, nullptr, kHelloToClient, session, KVB_ERR_BACKPRESSURE, nullptr, 0, false);
      return;
    }
    InboundHello in;
    char err[256] = "";
    const kvb_status_t st =
        h->auth_begin(h->host_ctx, "ucx", KVB_AUTH_SERVER, nullptr, 0, &in.auth, err, sizeof(err));
    if (st != KVB_OK) {
      t_->Log(KVB_LOG_WARN, std::string("ucx: cannot serve a hello: ") + err);
      SendAm(reply_ep, nullptr, kHelloToClient, session, st, nullptr, 0, false);
      return;
    }
    in.expires_ns = t_->Now() + 2ull * cfg_->connect_timeout_ms * 1'000'000ull;
    it = inbound_.emplace(key, in).first;
    t_->counters().inbound_open.store(inbound_.size());
  }
  kvb_auth_t* auth = it->second.auth;
  const auto* in = reinterpret_cast<const uint8_t*>(msg.data());
  const auto in_len = static_cast<uint32_t>(msg.size());
  uint8_t out[KVB_AUTH_MAX_MESSAGE];
  uint32_t out_len = 0;
  char err[256] = "";
  kvb_status_t st;
  if (h->auth_need(h->host_ctx, auth, in, in_len) != int32_t(in_len)) {
    st = KVB_ERR_PROTOCOL;
    kvb_copy_message(err, sizeof(err), "malformed hello message");
  } else {
    st = h->auth_step(h->host_ctx, auth, in, in_len, out, sizeof(out), &out_len, err, sizeof(err));
  }
  if (out_len > 0 || (st != KVB_OK && st != KVB_IN_PROGRESS)) {
    SendAm(reply_ep, nullptr, kHelloToClient, session, st, out, out_len, false);
  }
  if (st == KVB_IN_PROGRESS) return;
  if (st != KVB_OK) {
    t_->counters().frames_rejected.fetch_add(1);
    t_->Log(KVB_LOG_WARN, std::string("ucx: refused a hello: ") + err);
  }
  h->auth_end(h->host_ctx, auth);
  inbound_.erase(it);
  t_->counters().inbound_open.store(inbound_.size());
}

void Worker::HandleAm(const AmMessage& m) {
  uint64_t seg = 0;
  if (m.kind >= kGrantRequest) {
    // A grant request may go on with the holder's error mode and endpoints (kGrantRequest).
    if (m.data.size() < sizeof(seg) ||
        (m.data.size() != sizeof(seg) &&
         (m.kind != kGrantRequest || m.data.size() < sizeof(seg) + 1))) {
      t_->counters().frames_rejected.fetch_add(1);
      return;
    }
    std::memcpy(&seg, m.data.data(), sizeof(seg));
  }
  auto ep_it = sessions_.find(m.session);
  Endpoint* ep = ep_it == sessions_.end() ? nullptr : ep_it->second;
  switch (m.kind) {
    case kHelloToServer:
      ServeHello(m.reply_ep, m.session, m.data);
      break;
    case kHelloToClient:
      if (ep != nullptr) {
        HelloStep(*ep, reinterpret_cast<const uint8_t*>(m.data.data()),
                  static_cast<uint32_t>(m.data.size()), m.status);
      }
      break;
    case kGrantRequest: {
      auto it = published_.find(seg);
      if (it != published_.end() && m.reply_ep != nullptr) {
        Grantee g{m.session, false, {}};
        if (m.data.size() > sizeof(seg)) {
          g.peer_mode = m.data[sizeof(seg)] != 0;
          g.endpoints = m.data.substr(sizeof(seg) + 1);
        }
        it->second.insert(std::move(g));
      }
      if (m.reply_ep != nullptr) {
        SendAm(m.reply_ep, nullptr, kGrantReply, m.session,
               it != published_.end() ? KVB_OK : KVB_ERR_NOT_REGISTERED,
               reinterpret_cast<const uint8_t*>(&seg), sizeof(seg), false);
      }
      break;
    }
    case kGrantReply:
      if (ep != nullptr && ep->state == Endpoint::State::kReady) {
        ep->grants[seg] =
            m.status == KVB_OK ? Endpoint::Grant::kGranted : Endpoint::Grant::kRefused;
      }
      break;
    case kRevoke:
      if (ep != nullptr && ep->state == Endpoint::State::kReady) {
        ep->grants[seg] = Endpoint::Grant::kRefused;
        ep->revoking.insert(seg);
        AckRevokes(*ep);
      } else if (m.reply_ep != nullptr) {
        // No such endpoint (any more): nothing of ours can touch the segment.
        SendAm(m.reply_ep, nullptr, kRevokeAck, m.session, KVB_OK,
               reinterpret_cast<const uint8_t*>(&seg), sizeof(seg), false);
      }
      break;
    case kRevokeAck:
      for (auto& r : revocations_) {
        if (r.segment == seg) r.waiting.erase(m.session);
      }
      break;
    default:
      t_->counters().frames_rejected.fetch_add(1);
  }
}

void Worker::AckRevokes(Endpoint& ep) {
  for (auto it = ep.revoking.begin(); it != ep.revoking.end();) {
    const uint64_t seg = *it;
    bool busy = false;
    for (Record* r : ep.records) busy = busy || (r->slice && r->slice->segment == seg);
    if (busy) {
      ++it;
      continue;
    }
    // Put completion over tcp is acknowledged by the target, and cma is synchronous: with no
    // RMA on the segment in flight, none can land after this acknowledgement.
    if (auto k = ep.rkeys.find(seg); k != ep.rkeys.end()) {
      ucp_rkey_destroy(k->second.rkey);
      ep.rkeys.erase(k);
    }
    SendAm(ep.ep, &ep, kRevokeAck, ep.session, KVB_OK, reinterpret_cast<const uint8_t*>(&seg),
           sizeof(seg), false);
    it = ep.revoking.erase(it);
  }
}

void Worker::Published(uint64_t segment_id) { published_[segment_id]; }

void Worker::Revoke(uint64_t segment_id, ucp_mem_h memh, uint8_t* base, uint64_t length,
                    std::function<void()> done) {
  Revocation r{segment_id, memh, base, length, {}, 0, std::move(done), {}};
  r.deadline_ns = t_->Now() + uint64_t(cfg_->progress_timeout_ms) * 1'000'000ull;
  if (auto it = published_.find(segment_id); it != published_.end()) {
    for (const Grantee& g : it->second) {
      bool gone = false;
      Endpoint* back = BackEndpoint(g, &gone);
      if (gone) continue;
      // Unreachable, or no address: not acknowledged, so the progress timeout bounds the wait.
      r.waiting.insert(g.session);
      if (back == nullptr) continue;
      ++back->back_users;
      r.back.push_back(back);
      // With the reply flag, a holder whose endpoint is gone answers at once on this one.
      SendAm(back->ep, back, kRevoke, g.session, KVB_OK,
             reinterpret_cast<const uint8_t*>(&segment_id), sizeof(segment_id), true);
    }
    published_.erase(it);
  }
  revocations_.push_back(std::move(r));
}

Endpoint* Worker::BackEndpoint(const Grantee& g, bool* gone) {
  *gone = false;
  PeerAddress address;
  std::string err;
  if (g.endpoints.empty() || !ParseEndpoints(g.endpoints, &address, &err)) return nullptr;
  const bool same_host = address.host_key == t_->host_key();
  if (same_host && kill(address.pid, 0) != 0 && errno == ESRCH) {
    *gone = true;
    return nullptr;
  }
  const auto key = std::make_pair(g.endpoints, g.peer_mode);
  if (auto it = back_eps_.find(key); it != back_eps_.end()) {
    if (it->second->error == UCS_OK) return it->second.get();
    // Failed: the revocations that sent on it keep their pointer until they end.
    if (it->second->back_users != 0) return nullptr;
    Retire(std::move(it->second));
    back_eps_.erase(it);
  }
  auto ep = std::make_unique<Endpoint>();
  ep->peer_mode = g.peer_mode;
  ep->state = Endpoint::State::kReady;
  ep->back_pid = same_host ? address.pid : 0;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(address.worker_address.data());
  params.err_mode = g.peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (g.peer_mode) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = OnEpError;
    params.err_handler.arg = ep.get();
  }
  const ucs_status_t st = ucp_ep_create(worker_, &params, &ep->ep);
  if (st != UCS_OK) {
    t_->Log(KVB_LOG_WARN, "ucx: cannot reach a grant holder (pid " + std::to_string(address.pid) +
                              ") to revoke its grant: " + UcsText(st));
    return nullptr;
  }
  Endpoint* raw = ep.get();
  back_eps_[key] = std::move(ep);
  return raw;
}

void Worker::SweepBackEndpoints() {
  for (auto it = back_eps_.begin(); it != back_eps_.end();) {
    Endpoint& ep = *it->second;
    const bool gone =
        ep.error != UCS_OK || (ep.back_pid != 0 && kill(ep.back_pid, 0) != 0 && errno == ESRCH);
    if (ep.back_users == 0 && gone) {
      Retire(std::move(it->second));
      it = back_eps_.erase(it);
    } else {
      ++it;
    }
  }
}

void Worker::Retire(std::unique_ptr<Endpoint> ep) {
  ep->state = Endpoint::State::kClosing;
  if (ep->peer_mode && ep->force_at_ns == 0) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep->ep, &p);
    ep->close_started = true;
    if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
  }
  closing_.push_back(std::move(ep));
}

}  // namespace kvbridge::ucx
