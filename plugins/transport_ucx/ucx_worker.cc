#include "ucx_worker.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <random>

namespace kvbridge::ucx {
namespace {

constexpr unsigned kAmId = 0x4b56;  // one AM id for both directions of the hello
constexpr uint32_t kHelloToServer = 1;
constexpr uint32_t kHelloToClient = 2;
// Grants (payload: the u64 segment id): an initiator asks before its first RMA to a segment on
// an endpoint; the target revokes before its deregister_memory returns.
constexpr uint32_t kGrantRequest = 3;
constexpr uint32_t kGrantReply = 4;  // status KVB_OK or KVB_ERR_NOT_REGISTERED
constexpr uint32_t kRevoke = 5;
constexpr uint32_t kRevokeAck = 6;
constexpr uint64_t kTagCmd = 1;  // epoll tag of the command eventfd; anything else is a Peer*

// The AM header of every hello message; the auth message is the AM payload.
struct HelloHeader {
  uint64_t session;
  int32_t status;  // the sender's auth_step result (KVB_IN_PROGRESS, KVB_OK or an error)
  uint32_t kind;
};

std::string UcsText(ucs_status_t st) { return ucs_status_string(st); }

}  // namespace

// One UCX operation in flight. kPut/kGet touch `slice`'s local memory until they complete.
struct Record {
  enum class Kind { kPut, kGet, kFlush, kAm };
  Kind kind;
  Worker* worker;
  Endpoint* ep;  // null for hello replies on a server's reply endpoint
  SlicePtr slice;
  bool detached = false;  // no longer counted in the request's in_ucx (its peer has exited)
  std::vector<SlicePtr> flushed;
  HelloHeader header{};
  std::string data;
};

kvb_status_t Worker::Create(Transport* t, std::unique_ptr<Worker>* out, std::string* err) {
  std::unique_ptr<Worker> w(new Worker(t));
  const kvb_status_t st = w->Init(err);
  if (st != KVB_OK) return st;
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  *out = std::move(w);
  return KVB_OK;
}

kvb_status_t Worker::Init(std::string* err) {
  cfg_ = &t_->config();
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) {
    *err = "ucx: ucp_config_read: " + UcsText(st);
    return KVB_ERR_UNAVAILABLE;
  }
  if (!cfg_->tls.empty()) {
    st = ucp_config_modify(config, "TLS", cfg_->tls.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      *err = "ucx.tls: '" + cfg_->tls + "' refused by UCX: " + UcsText(st);
      return KVB_ERR_INVALID_ARGUMENT;
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // No UCP_FEATURE_WAKEUP: with it UCX 1.13 keeps only transports that can signal an fd,
  // which drops cma, and same-host RMA then runs as active messages over shared memory that
  // need the target's progress (measured: 0.05 GB/s at 1 MiB instead of cma's GB/s). The
  // thread polls instead: it spins while UCX reports work and sleeps ucx.idle_poll_ms when idle.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    *err = "ucx: ucp_init: " + UcsText(st);
    return KVB_ERR_UNAVAILABLE;
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    *err = "ucx: ucp_worker_create: " + UcsText(st);
    return KVB_ERR_UNAVAILABLE;
  }
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) {
    *err = "ucx: ucp_worker_get_address: " + UcsText(st);
    return KVB_ERR_UNAVAILABLE;
  }
  address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kAmId;
  am.cb = OnAm;
  am.arg = this;
  st = ucp_worker_set_am_recv_handler(worker_, &am);
  if (st != UCS_OK) {
    *err = "ucx: ucp_worker_set_am_recv_handler: " + UcsText(st);
    return KVB_ERR_UNAVAILABLE;
  }
  cmdfd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (cmdfd_ < 0 || epfd_ < 0) {
    *err = std::string("ucx: eventfd/epoll: ") + strerror(errno);
    return KVB_ERR_INTERNAL;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTagCmd;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, cmdfd_, &ev);
  std::random_device rd;
  next_session_ = (uint64_t(rd()) << 32) ^ rd();
  return KVB_OK;
}

Worker::~Worker() {
  if (thread_.joinable()) {
    Run([this] { stop_ = true; });
    thread_.join();
  }
  // The thread is gone: this thread may call UCX now. Endpoints left are closing ones.
  for (auto& ep : closing_) {
    for (auto& [seg, key] : ep->rkeys) ucp_rkey_destroy(key.rkey);
    ep->rkeys.clear();
    if (!ep->close_started && ep->ep != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = ep->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* r = ucp_ep_close_nbx(ep->ep, &p);
      ep->close_started = true;
      if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
    }
  }
  // Bounded wait for closes (a NONE-mode endpoint to a frozen peer may never flush).
  const uint64_t until = t_->Now() + 200'000'000ull;
  while (worker_ != nullptr && t_->Now() < until) {
    ucp_worker_progress(worker_);
    bool pending = false;
    for (auto& ep : closing_) {
      if (ep->close_req != nullptr && ucp_request_check_status(ep->close_req) == UCS_INPROGRESS) {
        pending = true;
      }
    }
    if (!pending) break;
  }
  for (auto& ep : closing_) {
    if (ep->close_req != nullptr) ucp_request_free(ep->close_req);
    ep->close_req = nullptr;
  }
  for (auto& [key, h] : inbound_) t_->host()->auth_end(t_->host()->host_ctx, h.auth);
  // ucp_worker_destroy completes what is still pending (OnDone runs): endpoints stay until then.
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  for (auto& ep : closing_) DestroyEndpoint(ep);
  closing_.clear();
  if (context_ != nullptr) ucp_cleanup(context_);
  if (cmdfd_ >= 0) close(cmdfd_);
  if (epfd_ >= 0) close(epfd_);
}

void Worker::Run(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    cmds_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  (void)!write(cmdfd_, &one, sizeof(one));
}

void Worker::RunSync(std::function<void()> fn) {
  std::promise<void> ran;
  Run([&] {
    fn();
    ran.set_value();
  });
  ran.get_future().wait();
}

bool Worker::DrainCommands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    cmds.swap(cmds_);
  }
  for (auto& c : cmds) c();
  return !cmds.empty();
}

bool Worker::Busy() const { return records_ > 0 || hellos_ > 0; }

void Worker::Loop() {
  while (!stop_) {
    bool did = DrainCommands();
    while (ucp_worker_progress(worker_) != 0) did = true;
    std::vector<AmMessage> msgs;
    msgs.swap(am_in_);
    for (auto& m : msgs) HandleAm(m);
    did = did || !msgs.empty();
    for (Peer* p : peers_) Pump(*p);
    const uint64_t now = t_->Now();
    Timers(now);
    ReapClosing();
    if (!done_.empty()) {
      Completions done;
      done.swap(done_);
      Transport::RunCompletions(done);
      did = true;
    }
    if (did) last_activity_ns_ = now;
    if (did || stop_) continue;
    // UCX 1.13 runs put/get as active messages over shared memory (cma serves only rendezvous)
    // and over tcp: the target must drain them. Keep progressing for ucx.spin_us after the last
    // sign of activity, so a stream of incoming fragments never waits for a sleep to end.
    if (t_->Now() - last_activity_ns_ < uint64_t(cfg_->spin_us) * 1000) continue;
    if (Busy()) {
      // Spin a little: a completion usually follows within microseconds.
      const uint64_t until = t_->Now() + uint64_t(cfg_->spin_us) * 1000;
      bool moved = false;
      while (!moved && t_->Now() < until) moved = ucp_worker_progress(worker_) != 0;
      if (moved) continue;
    }
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      if (!cmds_.empty()) continue;
    }
    // Idle: sleep until a command, a same-host peer's exit, or ucx.idle_poll_ms (a peer's tcp
    // software RMA and hellos need this worker progressed; there is no UCX fd to wait on).
    int timeout_ms = static_cast<int>(cfg_->idle_poll_ms);
    if (Busy() || !unmaps_.empty() || !inbound_.empty() || !revocations_.empty()) {
      timeout_ms = std::min(timeout_ms, 5);
    }
    if (!deadlines_.empty()) {
      const uint64_t at = deadlines_.top().at;
      const uint64_t ms = at <= now ? 0 : (at - now + 999'999) / 1'000'000;
      timeout_ms = static_cast<int>(std::min<uint64_t>(timeout_ms, ms));
    }
    epoll_event evs[16];
    const int n = epoll_wait(epfd_, evs, 16, timeout_ms);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.u64 == kTagCmd) {
        uint64_t v;
        (void)!read(cmdfd_, &v, sizeof(v));
      } else {
        Peer* p = static_cast<Peer*>(evs[i].data.ptr);
        if (peers_.count(p) != 0) CheckPeerExited(*p);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Memory.

kvb_status_t Worker::MapMemory(void* addr, uint64_t length, ucp_mem_h* memh, std::string* rkey,
                               std::string* err) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = addr;
  mp.length = length;
  ucs_status_t st = ucp_mem_map(context_, &mp, memh);
  if (st != UCS_OK) {
    *err = "ucx: ucp_mem_map: " + UcsText(st);
    return KVB_ERR_INTERNAL;
  }
  void* packed = nullptr;
  size_t packed_len = 0;
  st = ucp_rkey_pack(context_, *memh, &packed, &packed_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, *memh);
    *err = "ucx: ucp_rkey_pack: " + UcsText(st);
    return KVB_ERR_INTERNAL;
  }
  // [u64 little-endian base address][packed rkey]: the ABI's peer segment has no base.
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  rkey->clear();
  for (int i = 0; i < 8; ++i) rkey->push_back(static_cast<char>((base >> (8 * i)) & 0xff));
  rkey->append(static_cast<const char*>(packed), packed_len);
  ucp_rkey_buffer_release(packed);
  return KVB_OK;
}

void Worker::UnmapWhenIdle(ucp_mem_h memh, uint8_t* base, uint64_t length,
                           std::function<void()> done) {
  unmaps_.push_back(Unmap{memh, base, length, std::move(done)});
}

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
  if (peer->ep) CloseEndpoint(*peer, KVB_ERR_CANCELLED, "peer removed", false);
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
  // RMA cannot be cancelled: a PEER-mode endpoint is force-closed (UCX then completes its
  // operations CANCELED, and other requests' slices go back to the queue). A NONE-mode
  // endpoint may not be force-closed; its issued slices finish on their own.
  if (in_ucx && peer->ep && peer->ep->peer_mode) {
    CloseEndpoint(*peer, KVB_ERR_CANCELLED, "cancelled", true);
  }
}

void Worker::FailQueue(Peer& peer, kvb_status_t code, const std::string& msg) {
  std::deque<SlicePtr> q;
  q.swap(peer.queue);
  for (auto& s : q) t_->EndSlice(*s, code, msg, &done_);
}

void Worker::CloseEndpoint(Peer& peer, kvb_status_t code, const std::string& msg, bool requeue) {
  std::unique_ptr<Endpoint> ep = std::move(peer.ep);
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
  ep->state = Endpoint::State::kClosing;
  t_->counters().connections_open.fetch_sub(1);
  if (code != KVB_OK && code != KVB_ERR_CANCELLED) t_->counters().connections_evicted.fetch_add(1);
  if (ep->peer_mode) {
    // Force close: UCX completes the endpoint's operations (CANCELED) and stops touching memory.
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep->ep, &p);
    ep->close_started = true;
    if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
  }
  // NONE mode: never force-closed (undefined there); ReapClosing closes it once idle.
  closing_.push_back(std::move(ep));
}

void Worker::ReapClosing() {
  for (auto it = closing_.begin(); it != closing_.end();) {
    Endpoint& ep = **it;
    if (!ep.close_started && ep.records.empty()) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = 0;
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

// ---------------------------------------------------------------------------------------------
// Client side: endpoint, hello, RMA.

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
  auto* rec = new Record{Record::Kind::kAm, this, owner, nullptr, {}, {}, {}};
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
    const uint64_t seg = s->segment;
    SendAm(ep.ep, &ep, kGrantRequest, ep.session, KVB_OK, reinterpret_cast<const uint8_t*>(&seg),
           sizeof(seg), true);
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
  auto* rec = new Record{put ? Record::Kind::kPut : Record::Kind::kGet, this, &ep, s, {}, {}, {}};
  if (ep.records.empty()) ep.last_progress_ns = t_->Now();
  if (ep.records.empty() || req.progress_timeout_ns < ep.progress_timeout_ns) {
    ep.progress_timeout_ns = req.progress_timeout_ns;
  }
  ep.records.insert(rec);
  ++records_;
  ep.inflight_bytes += s->length;
  if (put) ep.unflushed.push_back(s);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = OnSend;
  p.user_data = rec;
  const uint64_t raddr = it->second.base + s->offset;
  void* r = put ? ucp_put_nbx(ep.ep, s->local, s->length, raddr, it->second.rkey, &p)
                : ucp_get_nbx(ep.ep, s->local, s->length, raddr, it->second.rkey, &p);
  if (!UCS_PTR_IS_PTR(r)) OnDone(rec, UCS_PTR_STATUS(r));
  return true;
}

void Worker::Flush(Endpoint& ep) {
  auto* rec = new Record{Record::Kind::kFlush, this, &ep, nullptr, {}, {}, {}};
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

// ---------------------------------------------------------------------------------------------
// Server side: hellos.

ucs_status_t Worker::OnAm(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param) {
  auto* w = static_cast<Worker*>(arg);
  HelloHeader h;
  if (header_length != sizeof(h) || length > KVB_AUTH_MAX_MESSAGE ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    w->t_->counters().frames_rejected.fetch_add(1);
    w->t_->Log(KVB_LOG_WARN, "ucx: dropped a malformed hello message");
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof(h));
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
    if (m.data.size() != sizeof(seg)) {
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
      if (it != published_.end() && m.reply_ep != nullptr)
        it->second.insert({m.reply_ep, m.session});
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
  Revocation r{segment_id, memh, base, length, {}, 0, std::move(done)};
  r.deadline_ns = t_->Now() + uint64_t(cfg_->progress_timeout_ms) * 1'000'000ull;
  if (auto it = published_.find(segment_id); it != published_.end()) {
    for (const Grantee& g : it->second) {
      if (SendAm(g.reply_ep, nullptr, kRevoke, g.session, KVB_OK,
                 reinterpret_cast<const uint8_t*>(&segment_id), sizeof(segment_id), true)) {
        r.waiting.insert(g.session);
      }
    }
    published_.erase(it);
  }
  revocations_.push_back(std::move(r));
}

// ---------------------------------------------------------------------------------------------
// Timers.

void Worker::Timers(uint64_t now) {
  if (now >= next_liveness_ns_) {
    // NONE-mode endpoints have no UCX error handling: a peer that exited while RMA is in
    // flight is noticed here even when the loop never sleeps in epoll.
    next_liveness_ns_ = now + 1'000'000;
    for (Peer* p : peers_) {
      if (p->same_host && p->ep && !p->ep->records.empty()) CheckPeerExited(*p);
    }
  }
  while (!deadlines_.empty() && deadlines_.top().at <= now) {
    DeadlineEntry e = deadlines_.top();
    deadlines_.pop();
    auto req = e.req.lock();
    if (!req) continue;
    {
      std::lock_guard<std::mutex> lock(req->mu);
      if (req->final) continue;
    }
    t_->FailRequest(*req, KVB_ERR_DEADLINE_EXCEEDED, "ucx: the deadline passed", &done_);
    Abort(req);
  }
  for (Peer* p : peers_) {
    if (!p->ep) continue;
    Endpoint& ep = *p->ep;
    if (ep.state == Endpoint::State::kHello && now >= ep.hello_deadline_ns) {
      const std::string msg = "ucx: peer '" + p->node_id + "' did not answer the hello within " +
                              std::to_string(cfg_->connect_timeout_ms) +
                              " ms (ucx.connect_timeout_ms)";
      CloseEndpoint(*p, KVB_ERR_PEER_UNREACHABLE, msg, false);
      FailQueue(*p, KVB_ERR_PEER_UNREACHABLE, msg);
      continue;
    }
    if (ep.state == Endpoint::State::kReady && !ep.records.empty() &&
        now - ep.last_progress_ns > ep.progress_timeout_ns) {
      int kinds[4] = {0, 0, 0, 0};
      for (Record* r : ep.records) ++kinds[static_cast<int>(r->kind)];
      const std::string msg = "ucx: peer '" + p->node_id + "' moved no bytes for " +
                              std::to_string(ep.progress_timeout_ns / 1'000'000) + " ms (" +
                              std::to_string(kinds[0]) + " puts, " + std::to_string(kinds[1]) +
                              " gets, " + std::to_string(kinds[2]) + " flushes, " +
                              std::to_string(kinds[3]) + " hello messages outstanding)";
      std::vector<std::shared_ptr<Request>> stuck;
      for (Record* r : ep.records) {
        if (r->slice) stuck.push_back(r->slice->req);
        for (auto& s : r->flushed) stuck.push_back(s->req);
      }
      for (auto& r : stuck) t_->FailRequest(*r, KVB_ERR_PROGRESS_TIMEOUT, msg, &done_);
      t_->Log(KVB_LOG_WARN, msg + (ep.peer_mode ? "; endpoint force-closed"
                                                : "; endpoint abandoned (NONE mode)"));
      CloseEndpoint(*p, KVB_ERR_PROGRESS_TIMEOUT, msg, true);
    }
  }
  for (auto it = inbound_.begin(); it != inbound_.end();) {
    if (now >= it->second.expires_ns) {
      t_->host()->auth_end(t_->host()->host_ctx, it->second.auth);
      it = inbound_.erase(it);
    } else {
      ++it;
    }
  }
  t_->counters().inbound_open.store(inbound_.size());
  for (auto it = revocations_.begin(); it != revocations_.end();) {
    if (!it->waiting.empty() && now < it->deadline_ns) {
      ++it;
      continue;
    }
    if (!it->waiting.empty()) {
      t_->Log(KVB_LOG_WARN, "ucx: deregistering segment " + std::to_string(it->segment) + ": " +
                                std::to_string(it->waiting.size()) +
                                " peer(s) did not acknowledge the revocation within "
                                "ucx.progress_timeout_ms");
    }
    UnmapWhenIdle(it->memh, it->base, it->length, std::move(it->done));
    it = revocations_.erase(it);
  }
  for (auto it = unmaps_.begin(); it != unmaps_.end();) {
    auto uses = [&](const Endpoint& ep) {
      for (Record* r : ep.records) {
        if (r->slice && !r->detached && r->slice->local < it->base + it->length &&
            r->slice->local + r->slice->length > it->base) {
          return true;
        }
      }
      return false;
    };
    bool busy = false;
    for (Peer* p : peers_) busy = busy || (p->ep && uses(*p->ep));
    for (auto& ep : closing_) busy = busy || uses(*ep);
    if (busy) {
      ++it;
      continue;
    }
    ucp_mem_unmap(context_, it->memh);
    it->done();
    it = unmaps_.erase(it);
  }
}

}  // namespace kvbridge::ucx
