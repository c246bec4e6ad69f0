#include "nccl_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <utility>

namespace kvbridge::nccl {

namespace {

constexpr uint64_t kMs = 1000000;

std::string PeerName(const Peer& p) { return p.node_id + "#" + std::to_string(p.incarnation); }

// The op's status is still open (no one has ended it).
bool IsOpen(const Op& op) {
  std::lock_guard<std::mutex> lock(op.req->mu);
  return op.req->ops[op.index].status == KVB_IN_PROGRESS;
}

}  // namespace

// What a connector thread hands back: a connected, authenticated socket on which COMM was sent.
struct ConnectState {
  std::mutex mu;
  bool done = false;
  sdk::Status status;
  int fd = -1;
  ncclUniqueId id{};
};

// One outbound control connection and its communicator (initiator side).
struct Link {
  enum class State { kConnecting, kInitComm, kReady };
  State state = State::kConnecting;
  std::shared_ptr<ConnectState> connect;
  std::thread connector;
  int fd = -1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  uint64_t started_ns = 0;
  uint64_t last_progress_ns = 0;
  std::string in, out;
  // Accepted ops whose ncclSend/ncclRecv is not queued yet, in ACCEPT order, and the one NCCL
  // is still enqueueing (a non-blocking communicator answered ncclInProgress: no other NCCL
  // call on it until ncclCommGetAsyncError says success, and its event is recorded only then).
  std::deque<OpPtr> to_issue;
  OpPtr enqueuing;
};

// One op the target accepted: its call is queued in ACCEPT order, then its event recorded.
struct InOp {
  enum class State { kWaiting, kEnqueuing, kIssued };
  uint64_t id = 0;
  uint64_t segment = 0;
  uint32_t opcode = 0;
  uint8_t* addr = nullptr;
  uint64_t length = 0;
  State state = State::kWaiting;
  CudaEvent event = nullptr;
};

// One inbound control connection and its communicator (target side). Progress-thread-only.
struct Inbound {
  int fd = -1;
  std::string who;  // "node#incarnation" as the handshake proved
  ncclComm_t comm = nullptr;
  bool comm_ready = false;
  uint64_t comm_started_ns = 0;
  cudaStream_t stream = nullptr;
  std::string in, out;
  std::deque<Frame> pending;  // REQs that came before the communicator was ready
  std::deque<InOp> ops;
  bool closed = false;
};

struct Transport::Command {
  enum class Kind { kAddPeer, kPost, kCancel, kRemovePeer, kInbound, kDropSegment };
  Kind kind = Kind::kPost;
  Peer* peer = nullptr;
  std::vector<OpPtr> ops;
  std::shared_ptr<RequestState> req;
  int fd = -1;
  std::string who;
  uint64_t segment = 0;
  bool wait = false;
  bool done = false;  // guarded by cmd_mu_
};

sdk::Result<Config> LoadConfig(const sdk::Host& host) {
  Config c;
  auto u32 = [&](const char* key, uint32_t* field, uint32_t min, uint32_t max) -> sdk::Status {
    auto v = host.Config<uint32_t>(key, *field, min, max);
    if (!v.ok()) return v.status();
    *field = *v;
    return sdk::Status();
  };
  if (auto s = u32("nccl.max_inflight_ops_per_peer", &c.max_inflight_ops_per_peer, 1, 1u << 20);
      !s.ok())
    return s;
  if (auto s = u32("nccl.progress_timeout_ms", &c.progress_timeout_ms, 1, 3600000); !s.ok())
    return s;
  if (auto s = u32("nccl.connect_timeout_ms", &c.connect_timeout_ms, 1, 3600000); !s.ok()) return s;
  if (auto s = u32("nccl.max_inbound", &c.max_inbound, 1, 65536); !s.ok()) return s;
  if (auto s = u32("nccl.max_handshakes", &c.max_handshakes, 1, 65536); !s.ok()) return s;
  if (auto s = u32("nccl.idle_poll_ms", &c.idle_poll_ms, 1, 1000); !s.ok()) return s;
  auto dev = host.Config<int32_t>("nccl.device", c.device, 0, 1023);
  if (!dev.ok()) return dev.status();
  c.device = *dev;
  return c;
}

// ---- setup and teardown -------------------------------------------------------------------------

sdk::Result<std::unique_ptr<Transport>> Transport::CreateWith(sdk::Host host,
                                                              const kvb_transport_params_t& params,
                                                              const Nccl* nccl,
                                                              const CudaOps* cuda) {
  if (nccl == nullptr || cuda == nullptr) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: no NCCL or no CUDA driver");
  }
  auto node = host.NodeId();
  if (!node.ok()) return node.status();
  auto config = LoadConfig(host);
  if (!config.ok()) return config.status();
  std::string listen = "127.0.0.1:0";
  if (KVB_HAS_FIELD(&params, kvb_transport_params_t, listen) && params.listen != nullptr &&
      params.listen[0] != '\0') {
    listen = params.listen;
    listen = listen.substr(0, listen.find(','));  // one control listener: the first entry
  }
  auto addr = ParseHostPort(listen);
  if (!addr.ok()) return addr.status();
  std::unique_ptr<Transport> t(new Transport(host, *config, nccl, cuda));
  if (sdk::Status st = t->Start(*addr); !st.ok()) return st;
  return t;
}

Transport::Transport(sdk::Host host, Config config, const Nccl* nccl, const CudaOps* cuda)
    : host_(host), config_(config), nccl_(nccl), cuda_(cuda) {}

sdk::Status Transport::Start(const ControlAddress& listen) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string where = listen.host + ":" + std::to_string(listen.port);
  if (getaddrinfo(listen.host.c_str(), std::to_string(listen.port).c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: cannot resolve listen address " + where);
  }
  listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (listen_fd_ >= 0) setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok = listen_fd_ >= 0 && bind(listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
                  ::listen(listen_fd_, 128) == 0;
  freeaddrinfo(res);
  if (!ok) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: cannot listen for control connections on " +
                                                where + ": " + strerror(errno));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  bound_.host = listen.host;
  bound_.port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  listen_wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0 || listen_wake_fd_ < 0) {
    return sdk::Status(KVB_ERR_INTERNAL, std::string("nccl: eventfd: ") + strerror(errno));
  }
  std::promise<void> device_checked;
  auto checked = device_checked.get_future();
  progress_ = std::thread([this, &device_checked] { ProgressLoop(&device_checked); });
  checked.wait();
  if (!device_ready_) {
    stop_ = true;
    progress_.join();
    return sdk::Status(KVB_ERR_UNAVAILABLE, device_error_);
  }
  listener_ = std::thread([this] { ListenLoop(); });
  host_.Log(KVB_LOG_INFO, "control listener on %s; NCCL %s (%s); device %d",
            FormatEndpoints(bound_).c_str(), nccl_->version().c_str(), nccl_->path.c_str(),
            config_.device);
  return sdk::Status();
}

Transport::~Transport() {
  stop_ = true;
  if (listen_wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(listen_wake_fd_, &one, sizeof(one));
  }
  if (listener_.joinable()) listener_.join();
  Wake();
  if (progress_.joinable()) progress_.join();
  for (int fd : {listen_fd_, wake_fd_, listen_wake_fd_}) {
    if (fd >= 0) close(fd);
  }
}

void Transport::Wake() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void Transport::Submit(std::shared_ptr<Command> cmd, bool wait) {
  cmd->wait = wait;
  std::unique_lock<std::mutex> lock(cmd_mu_);
  commands_.push_back(cmd);
  lock.unlock();
  Wake();
  if (!wait) return;
  lock.lock();
  cmd_cv_.wait(lock, [&] { return cmd->done; });
}

// ---- ABI ops on the caller's thread -----------------------------------------------------------

std::string Transport::Endpoints() { return FormatEndpoints(bound_); }

sdk::Status Transport::RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer& key) {
  const std::string seg = "region " + std::to_string(r.segment_id);
  if (r.mem_kind != KVB_MEM_CUDA) {
    return sdk::Status(KVB_ERR_UNSUPPORTED,
                       "nccl: " + seg +
                           " is host memory; the nccl transport moves CUDA device memory only "
                           "(host memory goes through another transport, e.g. tcp)");
  }
  if (r.device_id != config_.device) {
    return sdk::Status(KVB_ERR_UNSUPPORTED, "nccl: " + seg + " is on CUDA device " +
                                                std::to_string(r.device_id) +
                                                "; this instance's communicators use device " +
                                                std::to_string(config_.device) + " (nccl.device)");
  }
  if (r.addr == nullptr || r.length == 0) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: " + seg + " is empty or NULL");
  }
  if (sdk::Status st = key.Set({}); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(regions_mu_);
  if (!regions_.emplace(r.segment_id, Region{static_cast<uint8_t*>(r.addr), r.length}).second) {
    return sdk::Status(KVB_ERR_ALREADY_EXISTS, "nccl: " + seg + " is already registered");
  }
  ++counters_.device_regions_direct;
  return sdk::Status();
}

sdk::Status Transport::DeregisterMemory(uint64_t segment_id) {
  std::unique_lock<std::mutex> lock(regions_mu_);
  if (regions_.erase(segment_id) == 0) {
    return sdk::Status(KVB_ERR_NOT_FOUND,
                       "nccl: region " + std::to_string(segment_id) + " is not registered");
  }
  // New requests are refused from here on; wait for the ones already queued on a communicator.
  const bool idle =
      regions_cv_.wait_for(lock, std::chrono::milliseconds(config_.progress_timeout_ms),
                           [&] { return segment_busy_[segment_id] == 0; });
  lock.unlock();
  if (!idle) {
    auto cmd = std::make_shared<Command>();
    cmd->kind = Command::Kind::kDropSegment;
    cmd->segment = segment_id;
    Submit(cmd, true);
  }
  lock.lock();
  segment_busy_.erase(segment_id);
  return sdk::Status();
}

namespace {

sdk::Status ReadPeerInfo(const sdk::PeerInfo& info, ControlAddress* addr,
                         std::unordered_map<uint64_t, uint64_t>* segments) {
  auto a = ParseEndpoints(info.endpoints);
  if (!a.ok()) return a.status();
  *addr = *a;
  segments->clear();
  for (const sdk::PeerSegment s : info.segments) {
    if (s.mem_kind == KVB_MEM_CUDA) (*segments)[s.segment_id] = s.length;
  }
  return sdk::Status();
}

}  // namespace

sdk::Result<Peer*> Transport::AddPeer(const sdk::PeerInfo& info) {
  if (info.node_id.empty()) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: add_peer: the peer has no node id");
  }
  auto p = std::make_unique<Peer>();
  p->node_id = std::string(info.node_id);
  p->incarnation = info.incarnation;
  if (sdk::Status st = ReadPeerInfo(info, &p->address, &p->segments); !st.ok()) return st;
  auto cmd = std::make_shared<Command>();
  cmd->kind = Command::Kind::kAddPeer;
  cmd->peer = p.get();
  Submit(cmd, false);
  return p.release();
}

sdk::Status Transport::UpdatePeer(Peer* peer, const sdk::PeerInfo& info) {
  if (peer == nullptr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: update_peer: NULL");
  ControlAddress addr;
  std::unordered_map<uint64_t, uint64_t> segments;
  if (sdk::Status st = ReadPeerInfo(info, &addr, &segments); !st.ok()) return st;
  // As tcp and ucx: update_peer is for the same incarnation; a restarted peer is add_peer'd.
  if (info.node_id != peer->node_id || info.incarnation != peer->incarnation) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: update_peer: another incarnation is another peer (use add_peer)");
  }
  std::lock_guard<std::mutex> lock(peer->mu);
  peer->address = addr;
  peer->segments = std::move(segments);
  return sdk::Status();
}

void Transport::RemovePeer(Peer* peer) {
  if (peer == nullptr) return;
  auto cmd = std::make_shared<Command>();
  cmd->kind = Command::Kind::kRemovePeer;
  cmd->peer = peer;
  Submit(cmd, true);
}

sdk::Result<RequestHandle*> Transport::Post(Peer* peer, const sdk::Ops& ops,
                                            const sdk::PostOptions& opts) {
  if (peer == nullptr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: post: no peer");
  if (ops.empty()) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: post: no ops");
  auto req = std::make_shared<RequestState>();
  req->ops.resize(ops.size());
  req->unfinished = ops.size();
  req->on_complete = opts.on_complete;
  req->user = opts.user;
  const uint64_t progress_ns = opts.progress_timeout_ns != 0
                                   ? opts.progress_timeout_ns
                                   : uint64_t{config_.progress_timeout_ms} * kMs;
  std::vector<OpPtr> list;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> rl(regions_mu_);
    std::lock_guard<std::mutex> pl(peer->mu);
    for (uint32_t i = 0; i < ops.size(); ++i) {
      const kvb_xfer_op_t o = ops[i];
      const std::string which = "nccl: op " + std::to_string(i) + ": ";
      if (o.opcode != KVB_OP_READ && o.opcode != KVB_OP_WRITE) {
        return sdk::Status(KVB_ERR_INVALID_ARGUMENT, which + "opcode " + std::to_string(o.opcode) +
                                                         " is neither READ nor WRITE");
      }
      if (o.length == 0 || o.local_addr == nullptr) {
        return sdk::Status(KVB_ERR_INVALID_ARGUMENT, which + "empty or NULL local buffer");
      }
      auto r = regions_.find(o.local_segment);
      const auto* a = static_cast<const uint8_t*>(o.local_addr);
      if (r == regions_.end() || a < r->second.base || o.length > r->second.length ||
          static_cast<uint64_t>(a - r->second.base) > r->second.length - o.length) {
        return sdk::Status(KVB_ERR_NOT_REGISTERED,
                           which + "the local buffer is not inside registered CUDA region " +
                               std::to_string(o.local_segment));
      }
      auto s = peer->segments.find(o.remote_segment);
      if (s == peer->segments.end()) {
        return sdk::Status(KVB_ERR_NOT_REGISTERED, which + PeerName(*peer) +
                                                       " published no CUDA segment " +
                                                       std::to_string(o.remote_segment));
      }
      if (o.remote_offset > s->second || o.length > s->second - o.remote_offset) {
        return sdk::Status(KVB_ERR_OUT_OF_BOUNDS, which + "[" + std::to_string(o.remote_offset) +
                                                      ", +" + std::to_string(o.length) +
                                                      ") lies outside segment " +
                                                      std::to_string(o.remote_segment) + " of " +
                                                      std::to_string(s->second) + " bytes");
      }
      auto op = std::make_shared<Op>();
      op->req = req;
      op->index = i;
      op->opcode = o.opcode;
      op->local = static_cast<uint8_t*>(o.local_addr);
      op->segment = o.remote_segment;
      op->offset = o.remote_offset;
      op->length = o.length;
      op->deadline_ns = opts.deadline_ns;
      op->progress_timeout_ns = progress_ns;
      bytes += o.length;
      list.push_back(std::move(op));
    }
  }
  const uint32_t n = ops.size();
  const uint32_t before = peer->inflight_ops.fetch_add(n);
  if (before + n > config_.max_inflight_ops_per_peer) {
    peer->inflight_ops.fetch_sub(n);
    return sdk::Status(KVB_ERR_BACKPRESSURE,
                       "nccl: " + std::to_string(before) + " ops to " + PeerName(*peer) +
                           " are in flight; " + std::to_string(n) +
                           " more would pass "
                           "nccl.max_inflight_ops_per_peer (" +
                           std::to_string(config_.max_inflight_ops_per_peer) + ")");
  }
  counters_.queued_bytes += bytes;
  auto cmd = std::make_shared<Command>();
  cmd->kind = Command::Kind::kPost;
  cmd->peer = peer;
  cmd->ops = std::move(list);
  Submit(cmd, false);
  return handles_.Adopt(std::make_unique<RequestHandle>(RequestHandle{req}));
}

sdk::Status Transport::Poll(RequestHandle* h, std::span<kvb_status_t> op_status) {
  if (h == nullptr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "nccl: poll: NULL request");
  std::lock_guard<std::mutex> lock(h->req->mu);
  const RequestState& r = *h->req;
  for (size_t i = 0; i < op_status.size() && i < r.ops.size(); ++i) {
    op_status[i] = r.reported ? r.ops[i].status : KVB_IN_PROGRESS;
  }
  if (!r.reported) return sdk::Status(KVB_IN_PROGRESS);
  for (const OpState& o : r.ops) {
    if (o.status != KVB_OK) return sdk::Status(o.status, o.msg);
  }
  return sdk::Status();
}

void Transport::Cancel(RequestHandle* h) {
  if (h == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(h->req->mu);
    if (h->req->reported) return;
  }
  auto cmd = std::make_shared<Command>();
  cmd->kind = Command::Kind::kCancel;
  cmd->req = h->req;
  Submit(cmd, true);
}

void Transport::Release(RequestHandle* h) { handles_.Free(h); }

sdk::Status Transport::Stats(kvb_transport_stats_t& s) {
  s.connections_open = counters_.connections_open;
  s.connections_opened = counters_.connections_opened;
  s.connections_closed_idle = 0;
  s.connections_evicted = counters_.connections_evicted;
  s.inbound_open = counters_.inbound_open;
  s.bytes_written = counters_.bytes_written;
  s.bytes_read = counters_.bytes_read;
  s.frames_rejected = counters_.frames_rejected;
  s.queued_bytes = counters_.queued_bytes;
  s.device_regions_direct = counters_.device_regions_direct;
  return sdk::Status();
}

// ---- listener thread
// -----------------------------------------------------------------------------

void Transport::ListenLoop() {
  uint64_t refusals_logged_ns = 0;  // when a refusal at a bound was last logged
  uint64_t refusals_unlogged = 0;   // refusals since then
  while (!stop_) {
    ReapHandshakes(false);
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {listen_wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, 1000) <= 0) continue;
    if (stop_) break;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) continue;
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), serv, sizeof(serv),
                NI_NUMERICHOST | NI_NUMERICSERV);
    const std::string from = std::string(host) + ":" + serv;
    ReapHandshakes(false);
    // Refusals at the bounds are logged at most once a second, with how many were not, so a
    // flood of connections does not become a flood of log lines.
    auto refuse = [&](const std::string& why) {
      const uint64_t now = host_.NowNs();
      if (refusals_logged_ns == 0 || now - refusals_logged_ns >= 1000 * kMs) {
        host_.Log(KVB_LOG_WARN,
                  "refused control connection from %s: %s; %llu similar refusals not logged",
                  from.c_str(), why.c_str(), static_cast<unsigned long long>(refusals_unlogged));
        refusals_logged_ns = now;
        refusals_unlogged = 0;
      } else {
        ++refusals_unlogged;
      }
      close(fd);
    };
    if (counters_.inbound_open >= config_.max_inbound) {
      ++counters_.frames_rejected;  // counted before the close the client sees
      refuse(std::to_string(config_.max_inbound) + " are open (nccl.max_inbound)");
      continue;
    }
    if (counters_.handshakes_active >= config_.max_handshakes) {
      ++counters_.handshakes_refused;
      refuse(std::to_string(config_.max_handshakes) +
             " handshakes are in progress (nccl.max_handshakes)");
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto h = std::make_unique<Handshaker>();
    h->fd = fd;
    h->from = from;
    Handshaker* raw = h.get();
    ++counters_.handshakes_active;
    {
      std::lock_guard<std::mutex> lock(handshakes_mu_);
      handshakes_.push_back(std::move(h));
    }
    try {
      raw->thread = std::thread([this, raw] { ServeHandshake(raw); });
    } catch (const std::exception& e) {
      host_.Log(KVB_LOG_WARN, "refused control connection from %s: cannot start a thread: %s",
                from.c_str(), e.what());
      --counters_.handshakes_active;
      raw->done = true;  // reaped (and closed) below
    }
  }
  ReapHandshakes(true);
}

void Transport::ServeHandshake(Handshaker* h) {
  const uint64_t deadline = host_.NowNs() + uint64_t{config_.connect_timeout_ms} * kMs;
  auto who = Handshake(host_, h->fd, KVB_AUTH_SERVER, {}, 0, deadline);
  if (!who.ok()) {
    const bool timed_out = host_.NowNs() >= deadline;
    host_.Log(KVB_LOG_WARN, "refused control connection from %s: %s%s", h->from.c_str(),
              who.status().message().c_str(),
              timed_out ? (" (handshake not finished within nccl.connect_timeout_ms, " +
                           std::to_string(config_.connect_timeout_ms) + " ms)")
                              .c_str()
                        : "");
    ++counters_.frames_rejected;
  } else {
    bool hand_off;
    {
      std::lock_guard<std::mutex> lock(handshakes_mu_);
      hand_off = !stop_;
      h->handed_off = hand_off;
    }
    if (hand_off) {
      ++counters_.inbound_open;
      auto cmd = std::make_shared<Command>();
      cmd->kind = Command::Kind::kInbound;
      cmd->fd = h->fd;
      cmd->who = who->node_id + "#" + std::to_string(who->incarnation);
      Submit(cmd, false);
    }
  }
  --counters_.handshakes_active;
  h->done = true;
}

void Transport::ReapHandshakes(bool all) {
  std::vector<std::unique_ptr<Handshaker>> dead;
  {
    std::lock_guard<std::mutex> lock(handshakes_mu_);
    for (auto& h : handshakes_) {
      // A connection still in its handshake ends at once (its recv sees the shutdown).
      if (all && !h->handed_off && !h->done) shutdown(h->fd, SHUT_RDWR);
    }
    for (auto it = handshakes_.begin(); it != handshakes_.end();) {
      if (all || (*it)->done) {
        dead.push_back(std::move(*it));
        it = handshakes_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& h : dead) {
    if (h->thread.joinable()) h->thread.join();
    // Closed only after the join, so no thread uses a reused descriptor number.
    if (!h->handed_off) close(h->fd);
  }
}

// ---- progress thread
// -----------------------------------------------------------------------------

void Transport::ProgressLoop(std::promise<void>* device_checked) {
  // Every NCCL and CUDA call of this instance runs on this thread, in the device's primary
  // context.
  if (const int r = cuda_->use_device(config_.device); r != kCudaSuccess) {
    device_error_ = "nccl: cannot use CUDA device " + std::to_string(config_.device) +
                    " (nccl.device): " + cuda_->ErrorString(r);
  } else {
    device_ready_ = true;
  }
  device_checked->set_value();  // Start reads device_ready_ and device_error_ after this
  if (!device_ready_) return;
  while (!stop_) {
    Completions done;
    RunCommands(&done);
    const uint64_t now = host_.NowNs();
    bool busy = !finished_connectors_.empty();
    for (Peer* p : peers_) {
      ReadLink(*p, &done);
      DriveLink(*p, now, &done);
      if (p->link != nullptr &&
          (p->link->state != Link::State::kReady || !p->sent.empty() || !p->link->out.empty())) {
        busy = true;
      }
    }
    for (auto& in : inbound_) {
      if (!in->closed && ReadInbound(*in)) DriveInbound(*in, &done);
      if (!in->closed &&
          (!in->ops.empty() || (in->comm != nullptr && !in->comm_ready) || !in->out.empty())) {
        busy = true;
      }
    }
    inbound_.erase(
        std::remove_if(inbound_.begin(), inbound_.end(), [](const auto& in) { return in->closed; }),
        inbound_.end());
    RunCompletions(&done);
    // Connector threads whose link was dropped: join the ones that ended.
    for (auto it = finished_connectors_.begin(); it != finished_connectors_.end();) {
      if (!ReapConnector(*it, false)) {
        ++it;
      } else {
        it = finished_connectors_.erase(it);
      }
    }
    std::vector<pollfd> fds;
    fds.push_back({wake_fd_, POLLIN, 0});
    for (Peer* p : peers_) {
      if (p->link != nullptr && p->link->fd >= 0) {
        fds.push_back(
            {p->link->fd, static_cast<short>(POLLIN | (p->link->out.empty() ? 0 : POLLOUT)), 0});
      }
    }
    for (auto& in : inbound_) {
      fds.push_back({in->fd, static_cast<short>(POLLIN | (in->out.empty() ? 0 : POLLOUT)), 0});
    }
    std::unique_lock<std::mutex> lock(cmd_mu_);
    const bool pending = !commands_.empty();
    lock.unlock();
    if (pending) continue;
    poll(fds.data(), fds.size(), busy ? 1 : static_cast<int>(config_.idle_poll_ms));
    uint64_t drain = 0;
    (void)!read(wake_fd_, &drain, sizeof(drain));
  }
  DropEverything();
}

void Transport::RunCommands(Completions* done) {
  std::deque<std::shared_ptr<Command>> cmds;
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    cmds.swap(commands_);
  }
  for (auto& cmd : cmds) {
    switch (cmd->kind) {
      case Command::Kind::kAddPeer: {
        // Another incarnation of the same node: the ones known before are gone (the host's
        // engine replaces a peer record the same way). Their ops end STALE_PEER now, those on
        // a communicator included, and so does every op posted to them from here on.
        Peer* fresh = cmd->peer;
        for (Peer* q : peers_) {
          if (q->node_id != fresh->node_id || q->incarnation == fresh->incarnation ||
              q->superseded) {
            continue;
          }
          q->superseded = true;
          const std::string msg = "nccl: " + PeerName(*q) + " was replaced by incarnation " +
                                  std::to_string(fresh->incarnation) + " (add_peer)";
          host_.Log(KVB_LOG_INFO, "%s; its ops end STALE_PEER", msg.c_str());
          Teardown(*q, KVB_ERR_STALE_PEER, msg, false, done);
          FailQueued(*q, KVB_ERR_STALE_PEER, msg, done);
        }
        peers_.push_back(fresh);
        break;
      }
      case Command::Kind::kPost:
        for (auto& op : cmd->ops) cmd->peer->queued.push_back(op);
        if (cmd->peer->superseded) {
          FailQueued(*cmd->peer, KVB_ERR_STALE_PEER,
                     "nccl: " + PeerName(*cmd->peer) +
                         " was replaced by another incarnation (add_peer); post to that one",
                     done);
        }
        break;
      case Command::Kind::kCancel: {
        for (Peer* p : peers_) {
          for (auto it = p->queued.begin(); it != p->queued.end();) {
            if ((*it)->req == cmd->req) {
              Finish(**it, KVB_ERR_CANCELLED, "nccl: cancelled", done);
              p->inflight_ops.fetch_sub(1);
              it = p->queued.erase(it);
            } else {
              ++it;
            }
          }
          bool on_wire = false;
          for (auto& [id, op] : p->sent) {
            if (op->req == cmd->req) {
              Finish(*op, KVB_ERR_CANCELLED, "nccl: cancelled", done);
              on_wire = true;
            }
          }
          // NCCL cannot take back one queued call: the communicator goes, the others move on.
          if (on_wire) {
            Teardown(*p, KVB_ERR_CANCELLED, "nccl: communicator aborted to cancel a request", true,
                     done);
          }
        }
        break;
      }
      case Command::Kind::kRemovePeer: {
        Peer* p = cmd->peer;
        Teardown(*p, KVB_ERR_CANCELLED, "nccl: peer removed", false, done);
        FailQueued(*p, KVB_ERR_CANCELLED, "nccl: peer removed", done);
        peers_.erase(std::remove(peers_.begin(), peers_.end(), p), peers_.end());
        RunCompletions(done);
        delete p;
        break;
      }
      case Command::Kind::kInbound: {
        auto in = std::make_unique<Inbound>();
        in->fd = cmd->fd;
        in->who = cmd->who;
        host_.Log(KVB_LOG_DEBUG, "control connection from %s", in->who.c_str());
        inbound_.push_back(std::move(in));
        break;
      }
      case Command::Kind::kDropSegment:
        for (auto& in : inbound_) {
          for (const InOp& o : in->ops) {
            if (o.segment == cmd->segment && !in->closed) {
              CloseInbound(*in, "region " + std::to_string(cmd->segment) +
                                    " is being deregistered and its op did not end in time");
            }
          }
        }
        break;
    }
  }
  RunCompletions(done);
  std::lock_guard<std::mutex> lock(cmd_mu_);
  for (auto& cmd : cmds) cmd->done = true;
  cmd_cv_.notify_all();
}

void Transport::Finish(Op& op, kvb_status_t code, const std::string& msg, Completions* done) {
  std::lock_guard<std::mutex> lock(op.req->mu);
  OpState& s = op.req->ops[op.index];
  if (s.status != KVB_IN_PROGRESS) return;
  s.status = code;
  s.msg = msg;
  counters_.queued_bytes -= op.length;
  if (code == KVB_OK) {
    (op.opcode == KVB_OP_WRITE ? counters_.bytes_written : counters_.bytes_read) += op.length;
  }
  if (--op.req->unfinished == 0) {
    op.req->final = true;
    done->push_back(op.req);
  }
}

void Transport::RunCompletions(Completions* done) {
  for (auto& r : *done) {
    if (r->on_complete != nullptr) r->on_complete(r->user);
    std::lock_guard<std::mutex> lock(r->mu);
    r->reported = true;
  }
  done->clear();
}

bool Transport::ReapConnector(Connector& c, bool wait) {
  {
    std::lock_guard<std::mutex> lock(c.state->mu);
    if (!c.state->done && !wait) return false;
  }
  c.thread.join();
  if (c.state->fd >= 0) close(c.state->fd);
  c.state->fd = -1;
  return true;
}

void Transport::FailQueued(Peer& p, kvb_status_t code, const std::string& msg, Completions* done) {
  for (auto& op : p.queued) {
    Finish(*op, code, msg, done);
    p.inflight_ops.fetch_sub(1);
  }
  p.queued.clear();
}

void Transport::StartConnect(Peer& p) {
  auto link = std::make_unique<Link>();
  link->started_ns = host_.NowNs();
  link->connect = std::make_shared<ConnectState>();
  ControlAddress addr;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    addr = p.address;
  }
  const uint64_t deadline = link->started_ns + uint64_t{config_.connect_timeout_ms} * kMs;
  link->connector = std::thread([this, cs = link->connect, addr, node = p.node_id,
                                 inc = p.incarnation, deadline] {
    sdk::Status st;
    int fd = -1;
    ncclUniqueId id{};
    auto c = ConnectTo(addr, deadline, host_);
    if (!c.ok()) {
      st = c.status();
    } else {
      fd = *c;
      auto who = Handshake(host_, fd, KVB_AUTH_CLIENT, node, inc, deadline);
      if (!who.ok()) {
        st = who.status();
      } else if (const ncclResult_t r = nccl_->ncclGetUniqueId(&id); r != ncclSuccess) {
        st = sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: ncclGetUniqueId: " + nccl_->ErrorString(r));
      } else {
        Frame f;
        f.type = FrameType::kComm;
        f.id = id;
        const std::string bytes = EncodeFrame(f);
        st = SendAll(fd, bytes.data(), bytes.size(), deadline, host_);
      }
    }
    if (!st.ok() && fd >= 0) {
      close(fd);
      fd = -1;
    }
    std::lock_guard<std::mutex> lock(cs->mu);
    cs->status = st;
    cs->fd = fd;
    cs->id = id;
    cs->done = true;
  });
  p.link = std::move(link);
}

void Transport::OnConnected(Peer& p, Completions* done) {
  Link& l = *p.link;
  sdk::Status st;
  {
    std::lock_guard<std::mutex> lock(l.connect->mu);
    st = l.connect->status;
    l.fd = l.connect->fd;
    l.connect->fd = -1;
  }
  l.connector.join();
  if (!st.ok()) {
    host_.Log(KVB_LOG_WARN, "control connection to %s failed: %s", PeerName(p).c_str(),
              st.message().c_str());
    FailQueued(p, st.code(), st.message(), done);
    p.link.reset();
    return;
  }
  ++counters_.connections_opened;
  ncclResult_t r;
  if (nccl_->ncclCommInitRankConfig != nullptr) {
    ncclConfig_t cfg = MakeNcclConfig(0);
    r = nccl_->ncclCommInitRankConfig(&l.comm, 2, l.connect->id, 0, &cfg);
  } else {
    r = nccl_->ncclCommInitRank(&l.comm, 2, l.connect->id, 0);  // blocks until the target joins
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string msg =
        "nccl: communicator with " + PeerName(p) + " could not be made: " + nccl_->ErrorString(r);
    Teardown(p, KVB_ERR_PEER_UNREACHABLE, msg, false, done);
    FailQueued(p, KVB_ERR_PEER_UNREACHABLE, msg, done);
    return;
  }
  l.state = Link::State::kInitComm;
}

void Transport::DriveLink(Peer& p, uint64_t now, Completions* done) {
  if (p.link == nullptr) {
    if (!p.queued.empty()) StartConnect(p);
    CheckOps(p, now, done);
    return;
  }
  Link& l = *p.link;
  if (l.state == Link::State::kConnecting) {
    bool finished;
    {
      std::lock_guard<std::mutex> lock(l.connect->mu);
      finished = l.connect->done;
    }
    if (finished) OnConnected(p, done);
    CheckOps(p, now, done);
    return;
  }
  ncclResult_t async = ncclSuccess;
  const ncclResult_t r = nccl_->ncclCommGetAsyncError(l.comm, &async);
  if (l.state == Link::State::kInitComm) {
    if (r == ncclSuccess && async == ncclSuccess) {
      if (const int c = cuda_->stream_create(&l.stream); c != kCudaSuccess) {
        const std::string msg = "nccl: cannot create a CUDA stream: " + cuda_->ErrorString(c);
        Teardown(p, KVB_ERR_INTERNAL, msg, false, done);
        FailQueued(p, KVB_ERR_INTERNAL, msg, done);
        return;
      }
      l.state = Link::State::kReady;
      l.last_progress_ns = now;
      ++counters_.connections_open;
      host_.Log(KVB_LOG_DEBUG, "communicator with %s ready", PeerName(p).c_str());
    } else if ((r != ncclSuccess || async != ncclInProgress) ||
               (now > l.started_ns &&
                now - l.started_ns > uint64_t{config_.connect_timeout_ms} * kMs)) {
      const std::string msg = "nccl: communicator with " + PeerName(p) + " did not start: " +
                              (r != ncclSuccess || async != ncclInProgress
                                   ? nccl_->ErrorString(r != ncclSuccess ? r : async)
                                   : "no answer within nccl.connect_timeout_ms (" +
                                         std::to_string(config_.connect_timeout_ms) + ")");
      Teardown(p, KVB_ERR_PEER_UNREACHABLE, msg, false, done);
      FailQueued(p, KVB_ERR_PEER_UNREACHABLE, msg, done);
      return;
    } else {
      CheckOps(p, now, done);
      return;
    }
  } else if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
    const std::string msg = "nccl: the communicator with " + PeerName(p) + " reported an error: " +
                            nccl_->ErrorString(r != ncclSuccess ? r : async);
    host_.Log(KVB_LOG_WARN, "%s; aborting it", msg.c_str());
    Teardown(p, KVB_ERR_PEER_UNREACHABLE, msg, false, done);
    return;
  }
  // Ready: send the queued ops' requests, in order.
  while (!p.queued.empty()) {
    OpPtr op = p.queued.front();
    p.queued.pop_front();
    if (!IsOpen(*op)) continue;
    op->id = next_op_id_++;
    Frame f;
    f.type = FrameType::kReq;
    f.op_id = op->id;
    f.opcode = op->opcode;
    f.segment = op->segment;
    f.offset = op->offset;
    f.length = op->length;
    if (p.sent.empty()) l.last_progress_ns = now;
    l.out += EncodeFrame(f);
    op->sent = true;
    p.sent[op->id] = op;
  }
  if (!FlushOut(l.fd, &l.out)) {
    Teardown(p, KVB_ERR_PEER_UNREACHABLE,
             "nccl: control connection to " + PeerName(p) + " failed: " + strerror(errno), false,
             done);
    return;
  }
  if (!IssueAccepted(p, async, done)) return;
  // Completions of our side.
  for (auto it = p.sent.begin(); it != p.sent.end();) {
    Op& op = *it->second;
    if (op.issued && !op.local_done) {
      const int q = cuda_->event_query(op.event);
      if (q == kCudaSuccess) {
        op.local_done = true;
      } else if (q != kCudaNotReady) {
        const std::string msg =
            "nccl: CUDA event of op to " + PeerName(p) + " failed: " + cuda_->ErrorString(q);
        Teardown(p, KVB_ERR_IO, msg, false, done);
        return;
      }
    }
    if (op.local_done && op.remote_done) {
      cuda_->event_destroy(op.event);
      op.event = nullptr;
      Finish(op, KVB_OK, "", done);
      p.inflight_ops.fetch_sub(1);
      l.last_progress_ns = now;
      it = p.sent.erase(it);
    } else {
      ++it;
    }
  }
  CheckOps(p, now, done);
}

void Transport::CheckOps(Peer& p, uint64_t now, Completions* done) {
  for (auto it = p.queued.begin(); it != p.queued.end();) {
    Op& op = **it;
    if (op.deadline_ns != 0 && now >= op.deadline_ns) {
      Finish(op, KVB_ERR_DEADLINE_EXCEEDED,
             "nccl: the deadline passed before the op to " + PeerName(p) + " started", done);
      p.inflight_ops.fetch_sub(1);
      it = p.queued.erase(it);
    } else {
      ++it;
    }
  }
  if (p.link == nullptr || p.sent.empty()) return;
  bool expired = false;
  uint64_t progress_ns = UINT64_MAX;
  for (auto& [id, op] : p.sent) {
    if (op->deadline_ns != 0 && now >= op->deadline_ns && IsOpen(*op)) {
      Finish(
          *op, KVB_ERR_DEADLINE_EXCEEDED,
          "nccl: the op to " + PeerName(p) + " passed its deadline; its communicator was aborted",
          done);
      expired = true;
    }
    progress_ns = std::min(progress_ns, op->progress_timeout_ns);
  }
  if (expired) {
    host_.Log(KVB_LOG_WARN, "an op to %s passed its deadline: aborting the communicator",
              PeerName(p).c_str());
    Teardown(p, KVB_ERR_PEER_UNREACHABLE,
             "nccl: the communicator with " + PeerName(p) +
                 " was aborted after another op passed its deadline",
             true, done);
    return;
  }
  // last_progress_ns may be a little later than `now` (a frame read after this pass began).
  if (now > p.link->last_progress_ns && now - p.link->last_progress_ns > progress_ns) {
    const std::string msg = "nccl: no op to " + PeerName(p) + " ended for " +
                            std::to_string(progress_ns / kMs) + " ms; the communicator was aborted";
    host_.Log(KVB_LOG_WARN, "%s", msg.c_str());
    Teardown(p, KVB_ERR_PROGRESS_TIMEOUT, msg, false, done);
  }
}

void Transport::Teardown(Peer& p, kvb_status_t code, const std::string& msg, bool requeue,
                         Completions* done) {
  if (p.link != nullptr) {
    Link& l = *p.link;
    if (l.comm != nullptr) {
      nccl_->ncclCommAbort(l.comm);  // ends every call queued on it, on both streams' sides
      ++counters_.comms_aborted;
      l.comm = nullptr;
    }
    for (auto& [id, op] : p.sent) {
      if (op->event != nullptr) cuda_->event_destroy(op->event);
      op->event = nullptr;
    }
    if (l.stream != nullptr) cuda_->stream_destroy(l.stream);
    if (l.fd >= 0) close(l.fd);
    if (l.state == Link::State::kReady) --counters_.connections_open;
    // A connector still running is joined once it ended; it closes nothing itself.
    if (l.connector.joinable()) {
      finished_connectors_.push_back({std::move(l.connector), l.connect});
    }
    if (code != KVB_ERR_CANCELLED) ++counters_.connections_evicted;
    p.link.reset();
  }
  const uint64_t now = host_.NowNs();
  std::deque<OpPtr> again;
  for (auto& [id, op] : p.sent) {
    if (!IsOpen(*op)) {
      p.inflight_ops.fetch_sub(1);
      continue;
    }
    if (requeue && (op->deadline_ns == 0 || now < op->deadline_ns)) {
      op->sent = op->issued = op->local_done = op->remote_done = false;
      again.push_back(op);
    } else {
      Finish(*op, code, msg, done);
      p.inflight_ops.fetch_sub(1);
    }
  }
  p.sent.clear();
  p.queued.insert(p.queued.begin(), again.begin(), again.end());
}

void Transport::ReadLink(Peer& p, Completions* done) {
  if (p.link == nullptr || p.link->fd < 0) return;
  Link& l = *p.link;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(l.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      l.in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    const std::string msg = "nccl: control connection to " + PeerName(p) +
                            (n == 0 ? " closed by the peer" : std::string(": ") + strerror(errno));
    host_.Log(KVB_LOG_WARN, "%s", msg.c_str());
    // An op whose call we never made moved no byte (each NCCL call needs both sides): it goes
    // back to the queue, once, and the next connection's handshake tells a restarted peer
    // (STALE_PEER) from a dead one (its connect fails). The ones we issued may have moved
    // bytes: they end PEER_UNREACHABLE.
    std::deque<OpPtr> again;
    for (auto it = p.sent.begin(); it != p.sent.end();) {
      OpPtr op = it->second;
      if (!op->issued && op != l.enqueuing && !op->resent && IsOpen(*op)) {
        op->sent = op->local_done = op->remote_done = false;
        op->resent = true;
        again.push_back(std::move(op));
        it = p.sent.erase(it);
      } else {
        ++it;
      }
    }
    Teardown(p, KVB_ERR_PEER_UNREACHABLE, msg, false, done);
    p.queued.insert(p.queued.begin(), again.begin(), again.end());
    return;
  }
  size_t at = 0;
  while (p.link != nullptr) {
    Frame f;
    size_t used = 0;
    const sdk::Status st = DecodeFrame(std::string_view(l.in).substr(at), &f, &used);
    if (!st.ok()) {
      ++counters_.frames_rejected;
      host_.Log(KVB_LOG_WARN, "closing the control connection to %s: %s", PeerName(p).c_str(),
                st.message().c_str());
      Teardown(p, KVB_ERR_PROTOCOL, st.message(), false, done);
      return;
    }
    if (used == 0) break;
    at += used;
    OnFrame(p, f, done);
  }
  if (p.link != nullptr) l.in.erase(0, at);
}

void Transport::OnFrame(Peer& p, const Frame& f, Completions* done) {
  auto it = p.sent.find(f.op_id);
  if (f.type == FrameType::kComm || f.type == FrameType::kReq || it == p.sent.end()) {
    const std::string msg = "nccl: unexpected control frame (type " +
                            std::to_string(static_cast<int>(f.type)) + ", op " +
                            std::to_string(f.op_id) + ") from " + PeerName(p);
    ++counters_.frames_rejected;
    host_.Log(KVB_LOG_WARN, "%s", msg.c_str());
    Teardown(p, KVB_ERR_PROTOCOL, msg, false, done);
    return;
  }
  Op& op = *it->second;
  p.link->last_progress_ns = host_.NowNs();
  switch (f.type) {
    case FrameType::kAccept:
      p.link->to_issue.push_back(it->second);
      break;
    case FrameType::kRefuse: {
      const kvb_status_t code = f.status > KVB_IN_PROGRESS && f.status < KVB_STATUS_CODE_COUNT
                                    ? f.status
                                    : KVB_ERR_PROTOCOL;
      Finish(op, code, f.text, done);
      p.inflight_ops.fetch_sub(1);
      p.sent.erase(it);
      break;
    }
    case FrameType::kDone:
      if (f.status != KVB_OK) {
        Finish(
            op, KVB_ERR_PEER_UNREACHABLE,
            "nccl: " + PeerName(p) + "'s side of the op failed (" + std::to_string(f.status) + ")",
            done);
        Teardown(p, KVB_ERR_PEER_UNREACHABLE, "nccl: the communicator failed on the target", true,
                 done);
        return;
      }
      op.remote_done = true;
      break;
    default:
      break;
  }
}

bool Transport::IssueAccepted(Peer& p, ncclResult_t async, Completions* done) {
  Link& l = *p.link;
  auto fail = [&](Op& op, const std::string& why) {
    const std::string msg =
        "nccl: " + std::string(op.opcode == KVB_OP_WRITE ? "ncclSend" : "ncclRecv") + " to " +
        PeerName(p) + " failed: " + why;
    Finish(op, KVB_ERR_IO, msg, done);
    Teardown(p, KVB_ERR_PEER_UNREACHABLE, msg, true, done);
    return false;
  };
  auto record = [&](Op& op) {
    int c = cuda_->event_create(&op.event);
    if (c == kCudaSuccess) c = cuda_->event_record(op.event, l.stream);
    if (c != kCudaSuccess) return fail(op, cuda_->ErrorString(c));
    op.issued = true;
    return true;
  };
  if (l.enqueuing != nullptr) {
    if (async == ncclInProgress) return true;  // still enqueueing: no other call on the comm
    OpPtr op = std::move(l.enqueuing);
    if (!record(*op)) return false;
  }
  while (!l.to_issue.empty()) {
    OpPtr op = l.to_issue.front();
    l.to_issue.pop_front();
    const ncclResult_t r =
        op->opcode == KVB_OP_WRITE
            ? nccl_->ncclSend(op->local, op->length, ncclUint8, 1, l.comm, l.stream)
            : nccl_->ncclRecv(op->local, op->length, ncclUint8, 1, l.comm, l.stream);
    if (r == ncclInProgress) {
      l.enqueuing = op;
      return true;
    }
    if (r != ncclSuccess) return fail(*op, nccl_->ErrorString(r));
    if (!record(*op)) return false;
  }
  return true;
}

bool Transport::FlushOut(int fd, std::string* out) {
  while (!out->empty()) {
    const ssize_t w = send(fd, out->data(), out->size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      out->erase(0, static_cast<size_t>(w));
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    return w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  return true;
}

// ---- target side -------------------------------------------------------------------------------

bool Transport::ReadInbound(Inbound& in) {
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(in.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      in.in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    CloseInbound(in, n == 0 ? "closed by the initiator" : strerror(errno));
    return false;
  }
  size_t at = 0;
  while (!in.closed) {
    Frame f;
    size_t used = 0;
    const sdk::Status st = DecodeFrame(std::string_view(in.in).substr(at), &f, &used);
    if (!st.ok()) {
      ++counters_.frames_rejected;
      CloseInbound(in, st.message());
      return false;
    }
    if (used == 0) break;
    at += used;
    OnInboundFrame(in, f);
  }
  if (in.closed) return false;
  in.in.erase(0, at);
  return true;
}

void Transport::OnInboundFrame(Inbound& in, const Frame& f) {
  if (f.type == FrameType::kComm) {
    if (in.comm != nullptr) {
      ++counters_.frames_rejected;
      CloseInbound(in, "nccl: a second COMM frame on one control connection");
      return;
    }
    ncclResult_t r;
    if (nccl_->ncclCommInitRankConfig != nullptr) {
      ncclConfig_t cfg = MakeNcclConfig(0);
      r = nccl_->ncclCommInitRankConfig(&in.comm, 2, f.id, 1, &cfg);
    } else {
      r = nccl_->ncclCommInitRank(&in.comm, 2, f.id, 1);
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      in.comm = nullptr;
      CloseInbound(in, "nccl: cannot join the communicator: " + nccl_->ErrorString(r));
      return;
    }
    in.comm_started_ns = host_.NowNs();
    return;
  }
  if (f.type != FrameType::kReq) {
    ++counters_.frames_rejected;
    CloseInbound(in, "nccl: malformed control frame: type " +
                         std::to_string(static_cast<int>(f.type)) + " from an initiator");
    return;
  }
  if (in.comm == nullptr) {
    ++counters_.frames_rejected;
    CloseInbound(in, "nccl: malformed control frame: REQ before COMM");
    return;
  }
  if (!in.comm_ready) {
    in.pending.push_back(f);
    return;
  }
  auto refuse = [&](kvb_status_t code, const std::string& why) {
    ++counters_.frames_rejected;
    Frame r;
    r.type = FrameType::kRefuse;
    r.op_id = f.op_id;
    r.status = code;
    r.text = "nccl: " + why;
    in.out += EncodeFrame(r);
  };
  if (f.opcode != KVB_OP_READ && f.opcode != KVB_OP_WRITE) {
    refuse(KVB_ERR_INVALID_ARGUMENT, "opcode " + std::to_string(f.opcode) + " is unknown");
    return;
  }
  if (f.length == 0) {
    refuse(KVB_ERR_INVALID_ARGUMENT, "an op of 0 bytes");
    return;
  }
  uint8_t* addr = nullptr;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto r = regions_.find(f.segment);
    if (r == regions_.end()) {
      refuse(KVB_ERR_NOT_REGISTERED,
             "segment " + std::to_string(f.segment) + " is not registered at the target");
      return;
    }
    if (f.offset > r->second.length || f.length > r->second.length - f.offset) {
      refuse(KVB_ERR_OUT_OF_BOUNDS, "[" + std::to_string(f.offset) + ", +" +
                                        std::to_string(f.length) + ") lies outside segment " +
                                        std::to_string(f.segment) + " of " +
                                        std::to_string(r->second.length) + " bytes");
      return;
    }
    addr = r->second.base + f.offset;
    ++segment_busy_[f.segment];
  }
  InOp op;
  op.id = f.op_id;
  op.segment = f.segment;
  op.opcode = f.opcode;
  op.addr = addr;
  op.length = f.length;
  in.ops.push_back(op);  // its call is queued by DriveInbound, in this order
  Frame a;
  a.type = FrameType::kAccept;
  a.op_id = f.op_id;
  in.out += EncodeFrame(a);
}

void Transport::DriveInbound(Inbound& in, Completions* /*done*/) {
  if (in.comm != nullptr) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = nccl_->ncclCommGetAsyncError(in.comm, &async);
    if (!in.comm_ready) {
      if (r == ncclSuccess && async == ncclSuccess) {
        if (const int c = cuda_->stream_create(&in.stream); c != kCudaSuccess) {
          CloseInbound(in, "nccl: cannot create a CUDA stream: " + cuda_->ErrorString(c));
          return;
        }
        in.comm_ready = true;
        std::deque<Frame> pending;
        pending.swap(in.pending);
        for (const Frame& f : pending) {
          if (!in.closed) OnInboundFrame(in, f);
        }
        if (in.closed) return;
      } else if (r != ncclSuccess || async != ncclInProgress ||
                 host_.NowNs() - in.comm_started_ns > uint64_t{config_.connect_timeout_ms} * kMs) {
        CloseInbound(in, "nccl: the communicator did not start: " +
                             nccl_->ErrorString(r != ncclSuccess ? r : async));
        return;
      }
    } else if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      CloseInbound(in, "nccl: the communicator reported an error: " +
                           nccl_->ErrorString(r != ncclSuccess ? r : async));
      return;
    }
  }
  if (in.comm_ready && !IssueInbound(in)) return;
  while (!in.ops.empty() && in.ops.front().state == InOp::State::kIssued) {
    InOp& op = in.ops.front();
    const int q = cuda_->event_query(op.event);
    if (q == kCudaNotReady) break;
    Frame d;
    d.type = FrameType::kDone;
    d.op_id = op.id;
    d.status = q == kCudaSuccess ? KVB_OK : KVB_ERR_IO;
    in.out += EncodeFrame(d);
    cuda_->event_destroy(op.event);
    ChargeSegment(op.segment, -1);
    in.ops.pop_front();
    if (q != kCudaSuccess) {
      CloseInbound(in, "nccl: a CUDA event failed: " + cuda_->ErrorString(q));
      return;
    }
  }
  if (!FlushOut(in.fd, &in.out)) CloseInbound(in, std::string("send: ") + strerror(errno));
}

bool Transport::IssueInbound(Inbound& in) {
  ncclResult_t async = ncclSuccess;
  for (InOp& op : in.ops) {
    if (op.state == InOp::State::kIssued) continue;
    if (op.state == InOp::State::kWaiting) {
      const ncclResult_t r =
          op.opcode == KVB_OP_WRITE
              ? nccl_->ncclRecv(op.addr, op.length, ncclUint8, 0, in.comm, in.stream)
              : nccl_->ncclSend(op.addr, op.length, ncclUint8, 0, in.comm, in.stream);
      if (r != ncclSuccess && r != ncclInProgress) {
        CloseInbound(in, "nccl: queueing the target's side failed: " + nccl_->ErrorString(r));
        return false;
      }
      op.state = InOp::State::kEnqueuing;
      if (r == ncclInProgress) return true;  // asked again on the next pass
    } else if (const ncclResult_t r = nccl_->ncclCommGetAsyncError(in.comm, &async);
               r != ncclSuccess || async == ncclInProgress) {
      return true;  // still enqueueing (an error is found by DriveInbound's own check)
    }
    int c = cuda_->event_create(&op.event);
    if (c == kCudaSuccess) c = cuda_->event_record(op.event, in.stream);
    if (c != kCudaSuccess) {
      CloseInbound(in, "nccl: a CUDA event for the target's side failed: " + cuda_->ErrorString(c));
      return false;
    }
    op.state = InOp::State::kIssued;
  }
  return true;
}

void Transport::ChargeSegment(uint64_t segment, int delta) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  uint32_t& n = segment_busy_[segment];
  n = delta < 0 ? (n > 0 ? n - 1 : 0) : n + 1;
  if (n == 0) regions_cv_.notify_all();
}

void Transport::CloseInbound(Inbound& in, const std::string& why) {
  if (in.closed) return;
  in.closed = true;
  const bool normal = why == "closed by the initiator" && in.ops.empty();
  host_.Log(normal ? KVB_LOG_DEBUG : KVB_LOG_WARN, "closing the control connection from %s: %s",
            in.who.c_str(), why.c_str());
  if (in.comm != nullptr) {
    nccl_->ncclCommAbort(in.comm);
    if (!normal) ++counters_.comms_aborted;
    in.comm = nullptr;
  }
  for (InOp& op : in.ops) {
    if (op.event != nullptr) cuda_->event_destroy(op.event);
    ChargeSegment(op.segment, -1);
  }
  in.ops.clear();
  if (in.stream != nullptr) cuda_->stream_destroy(in.stream);
  in.stream = nullptr;
  close(in.fd);
  --counters_.inbound_open;
}

void Transport::DropEverything() {
  Completions done;
  RunCommands(&done);
  for (Peer* p : peers_) {
    Teardown(*p, KVB_ERR_CANCELLED, "nccl: transport destroyed", false, &done);
    FailQueued(*p, KVB_ERR_CANCELLED, "nccl: transport destroyed", &done);
  }
  for (auto& in : inbound_) CloseInbound(*in, "transport destroyed");
  inbound_.clear();
  RunCompletions(&done);
  for (auto& c : finished_connectors_) ReapConnector(c, true);
  finished_connectors_.clear();
  // Peers the host never removed: the ABI says destroy frees everything.
  for (Peer* p : peers_) delete p;
  peers_.clear();
}

}  // namespace kvbridge::nccl
