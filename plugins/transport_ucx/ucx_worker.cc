#include "ucx_worker.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <random>

#include "ucx_internal.h"

namespace kvbridge::ucx {
namespace {

constexpr uint64_t kTagCmd = 1;  // epoll tag of the command eventfd; anything else is a Peer*

}  // namespace

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
  // Which memory the context can move: CUDA only with a UCX built with CUDA (PyPI's
  // libucx-cu13) on a machine with a GPU and driver; Debian's UCX and any machine without a GPU
  // say host only.
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  st = ucp_context_query(context_, &attr);
  memory_types_ = st == UCS_OK ? attr.memory_types : UCS_BIT(UCS_MEMORY_TYPE_HOST);
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
  // The thread is gone: this thread may call UCX now. Endpoints left are closing ones, and
  // those made to send revocations.
  for (auto& [key, ep] : back_eps_) closing_.push_back(std::move(ep));
  back_eps_.clear();
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
    // `now` is this round's clock: reading it again each round cost a busy target about 5 % of
    // its time in clock_gettime (perf record of a target under 64 KiB writes).
    if (now - last_activity_ns_ < uint64_t(cfg_->spin_us) * 1000) continue;
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

kvb_status_t Worker::MapMemory(void* addr, uint64_t length, bool cuda, ucp_mem_h* memh,
                               std::string* rkey, std::string* err) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = addr;
  mp.length = length;
  mp.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
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
  DrainTimers(now);
  if (now >= next_back_sweep_ns_) {
    next_back_sweep_ns_ = now + 1'000'000'000;
    SweepBackEndpoints();
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
    for (Endpoint* back : it->back) --back->back_users;
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
