#include "verbs_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <random>
#include <string_view>

#include "socket_io.h"

namespace kvbridge::verbs {

namespace sdk = kvbridge::plugin::sdk;
using Done = std::vector<std::function<void()>>;

// ---- the instance's state (declared in the header) -------------------------------------------

struct Transport::DeviceCtx {
  std::string name;
  DeviceHandle dev;
  PdHandle pd;
  RcOptions qp;  // the QP options this device can take (config, clamped to its limits)
  std::unique_ptr<Registrar> registrar;
  std::unique_ptr<MrCache> mrs;
};

struct Transport::LocalNic {
  size_t device = 0;  // index into devices_
  std::string name;   // "mlx5_0"
  LocalPortInfo info;
  int numa_node = -1;
};

struct Transport::Region {
  uint64_t addr = 0;
  uint64_t length = 0;
  bool cuda = false;
  bool staged = false;          // CUDA memory moved through bounce buffers (no MRs)
  int device_id = -1;           // its CUDA device
  std::vector<MrRef> mrs;       // per device; empty when staged
  std::vector<uint32_t> rails;  // local NICs closest to the memory, closest first
};

struct ConnectJob {
  std::string host;
  uint16_t port = 0;
  PeerIncarnation peer;
  std::vector<std::pair<uint32_t, uint32_t>> pairs;  // (local NIC, remote NIC)
  std::vector<EndpointNic> remote_nics;
  std::atomic<bool> done{false};
  sdk::Status status;                                // of the exchange as a whole
  std::vector<std::unique_ptr<RcConnection>> conns;  // per pair; null when that pair failed
  std::vector<sdk::Status> pair_status;
};

struct OpState {
  kvb_status_t code = KVB_IN_PROGRESS;
  std::string msg;
  uint32_t left = 0;  // slices not ended
  sdk::Status first_error;
};

struct Slice {
  Request* req = nullptr;
  uint32_t op = 0;
  WrOpcode opcode = WrOpcode::kRdmaWrite;
  uint64_t local_addr = 0;
  uint64_t local_segment = 0;
  uint64_t remote_segment = 0;
  uint64_t remote_offset = 0;
  uint32_t length = 0;
  uint32_t rail = 0;                               // the rail the stripe plan gave it
  const std::vector<uint32_t>* allowed = nullptr;  // the request's rails for this op
  bool posted = false;
  uint32_t posted_rail = 0;
  bool ended = false;
  uint32_t tries = 0;
  // Host staging: the local memory is CUDA memory of `device` moved through bounce buffer
  // `bounce` of the peer's ring. A WRITE's bytes are copied in (kCopyIn) before it is posted
  // (then `filled`); a READ's are copied out (kCopyOut) once its RDMA completed.
  bool staged = false;
  int device = -1;
  int32_t bounce = -1;
  bool filled = false;
  enum class Copy { kNone, kIn, kOut } copy = Copy::kNone;
  uint64_t ticket = 0;
};

// A peer's host staging: `count` pinned bounce buffers of `buffer_bytes` in one allocation,
// registered (host memory) on every local device, and one copy queue per CUDA device. Made at
// the first staged op to the peer, so that a peer that stalls holds only its own buffers.
// Destroyed with the peer, after its rails are closed: waits for queued copies, releases and
// invalidates its MRs (so no cached MR outlives the memory), frees the memory.
struct StagingRing {
  sdk::Host host;
  uint8_t* base = nullptr;
  uint64_t buffer_bytes = 0;
  uint32_t count = 0;
  std::vector<MrCache*> caches;  // per local device
  std::vector<MrRef> mrs;        // per local device
  std::vector<int32_t> free;     // buffer indices
  std::map<int, sdk::DevStream> streams;

  StagingRing() = default;
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  ~StagingRing() {
    streams.clear();
    for (size_t i = 0; i < mrs.size(); ++i) {
      mrs[i].Release();
      caches[i]->Invalidate(reinterpret_cast<uint64_t>(base), buffer_bytes * count);
    }
    host.PinnedFree(base);
  }
  uint8_t* buffer(int32_t i) const { return base + static_cast<uint64_t>(i) * buffer_bytes; }
};

struct Request {
  Peer* peer = nullptr;
  std::vector<OpState> ops;
  std::vector<std::vector<uint32_t>> rails;  // per op
  std::vector<std::unique_ptr<Slice>> slices;
  size_t slices_left = 0;
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  uint64_t last_progress_ns = 0;
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  uint64_t charged_bytes = 0;
  uint64_t charged_ops = 0;
  bool final = false;
  // Failed (cancel, deadline, peer failure) while device copies of its staged slices still ran:
  // how many of those copies have not ended (its slices in Peer::draining). Not final until 0.
  uint32_t draining = 0;
  std::atomic<bool> reported{false};  // on_complete has returned

  // Final, or failed and waiting only for its copies: nothing more is done for it.
  bool Closed() const { return final || draining != 0; }
};

struct RemoteSegment {
  uint64_t length = 0;
  std::vector<RegionKey> keys;  // per remote NIC
};

struct RailConn {
  std::unique_ptr<RcConnection> conn;
  uint32_t remote_nic = 0;
  bool connecting = false;
  bool port_down = false;    // its port was not ACTIVE when last asked (at retry_at_ns)
  uint64_t retry_at_ns = 0;  // failed: not reconnected before
  std::string why;           // the last failure
};

struct Peer {
  std::string node_id;
  uint64_t incarnation = 0;
  verbs::Endpoints ep;
  std::unordered_map<uint64_t, RemoteSegment> segments;
  // Host staging, made at the first staged op; declared before `rails` so that it outlives
  // their QPs.
  std::unique_ptr<StagingRing> staging;
  std::vector<RailConn> rails;  // per local NIC
  std::shared_ptr<ConnectJob> job;
  std::thread job_thread;
  sdk::Status fatal;  // STALE_PEER or UNAUTHENTICATED: every later post fails with it
  std::deque<Slice*> queue;
  std::vector<Slice*> copying_out;  // staged READs whose copy-out runs
  std::vector<Slice*> draining;     // slices of failed requests whose device copy runs
  uint64_t drain_warned_ns = 0;     // when a long-running draining copy was last logged
  uint64_t queued_bytes = 0;
  uint64_t queued_ops = 0;
  std::set<Request*> requests;  // not final
};

namespace {

constexpr uint64_t kMsNs = 1000000;

bool IsRetryable(const OpEnd& e) {
  return e.flushed || e.status.code() == KVB_ERR_PEER_UNREACHABLE ||
         e.status.code() == KVB_ERR_CANCELLED;
}

std::string Who(const std::string& node, uint64_t inc) {
  return node + " incarnation " + std::to_string(inc);
}

// The side channel's socket I/O and handshake (plugins/common/socket_io.h), labelled.
constexpr std::string_view kSideChannel = "side channel";

bool WaitFd(const sdk::Host& h, int fd, short events, uint64_t deadline_ns) {
  return plugin::WaitFd(h, fd, events, deadline_ns, kSideChannel).ok();
}

sdk::Status SendAll(const sdk::Host& h, int fd, const uint8_t* p, size_t len, uint64_t deadline) {
  return plugin::SendAll(h, fd, p, len, deadline, kSideChannel);
}

sdk::Status RecvAll(const sdk::Host& h, int fd, uint8_t* p, size_t len, uint64_t deadline) {
  return plugin::RecvAll(h, fd, p, len, deadline, kSideChannel);
}

sdk::Status RunAuth(const sdk::Host& h, int fd, sdk::AuthSession& a, bool client,
                    uint64_t deadline) {
  return plugin::CarryHandshake(h, fd, a, client, deadline, kSideChannel);
}

sdk::Status SendFrame(const sdk::Host& h, int fd, const Frame& f, uint64_t deadline) {
  const std::vector<uint8_t> b = EncodeFrame(f);
  return SendAll(h, fd, b.data(), b.size(), deadline);
}

sdk::Result<Frame> RecvFrame(const sdk::Host& h, int fd, uint64_t deadline) {
  uint8_t len_bytes[4];
  if (auto st = RecvAll(h, fd, len_bytes, 4, deadline); !st.ok()) return st;
  const uint32_t len = len_bytes[0] | (len_bytes[1] << 8) | (len_bytes[2] << 16) |
                       (static_cast<uint32_t>(len_bytes[3]) << 24);
  if (len == 0 || len > kMaxFramePayload) {
    return sdk::Status(KVB_ERR_PROTOCOL, "malformed side-channel frame: length " +
                                             std::to_string(len) + " is not 1.." +
                                             std::to_string(kMaxFramePayload));
  }
  std::vector<uint8_t> payload(len);
  if (auto st = RecvAll(h, fd, payload.data(), len, deadline); !st.ok()) return st;
  return DecodeFrame(sdk::Bytes(payload));
}

}  // namespace

int HostNumaNodeOf(uint64_t addr) {
  int node = -1;
  // get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR): the node of the page at addr (faulted in).
  constexpr unsigned long kNodeOfAddr = (1ul << 0) | (1ul << 1);
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, reinterpret_cast<void*>(addr), kNodeOfAddr) !=
      0) {
    return -1;
  }
  return node;
}

namespace {

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

// ---- configuration ---------------------------------------------------------------------------

sdk::Result<Config> LoadConfig(const sdk::Host& host) {
  Config c;
  auto devices = host.Config<std::string>("verbs.devices", c.devices);
  if (!devices.ok()) return devices.status();
  c.devices = *devices;
  auto cm_listen = host.Config<std::string>("verbs.cm_listen", c.cm_listen);
  if (!cm_listen.ok()) return cm_listen.status();
  c.cm_listen = *cm_listen;
#define KVB_VERBS_KEY(key, field, min, max)                                   \
  do {                                                                        \
    auto v = host.Config<decltype(c.field)>("verbs." key, c.field, min, max); \
    if (!v.ok()) return v.status();                                           \
    c.field = *v;                                                             \
  } while (0)
  KVB_VERBS_KEY("max_rails", max_rails, 0u, 64u);
  KVB_VERBS_KEY("stripe_min_bytes", stripe_min_bytes, uint64_t{1}, uint64_t{1} << 40);
  KVB_VERBS_KEY("max_wr_bytes", max_wr_bytes, uint64_t{4096}, uint64_t{kMaxOpLength});
  KVB_VERBS_KEY("max_outstanding_wr", max_outstanding_wr, 1u, 16384u);
  KVB_VERBS_KEY("max_queued_bytes_per_peer", max_queued_bytes_per_peer, uint64_t{1},
                uint64_t{1} << 62);
  KVB_VERBS_KEY("max_queued_ops_per_peer", max_queued_ops_per_peer, uint64_t{1}, uint64_t{1} << 40);
  KVB_VERBS_KEY("progress_timeout_ms", progress_timeout_ms, 1u, 3600000u);
  KVB_VERBS_KEY("connect_timeout_ms", connect_timeout_ms, 1u, 600000u);
  KVB_VERBS_KEY("gid_index", gid_index, 0u, 255u);
  KVB_VERBS_KEY("rail_retry_ms", rail_retry_ms, 0u, 3600000u);
  KVB_VERBS_KEY("max_inbound_qps", max_inbound_qps, 1u, 1000000u);
  KVB_VERBS_KEY("max_handshakes", max_handshakes, 1u, 4096u);
  KVB_VERBS_KEY("host_staging", host_staging, 0u, 1u);
  KVB_VERBS_KEY("staging_buffer_bytes", staging_buffer_bytes, uint64_t{4096},
                uint64_t{kMaxOpLength});
  KVB_VERBS_KEY("staging_buffers", staging_buffers, 1u, 1024u);
#undef KVB_VERBS_KEY
  return c;
}

// ---- creation and teardown -------------------------------------------------------------------

Transport::Transport(sdk::Host host, Config config, Fabric fabric)
    : host_(host), config_(std::move(config)), fabric_(std::move(fabric)) {
  stats_.struct_size = sizeof(stats_);
}

sdk::Result<std::unique_ptr<Transport>> Transport::Create(sdk::Host host,
                                                          const kvb_transport_params_t& params,
                                                          Fabric fabric) {
  auto config = LoadConfig(host);
  if (!config.ok()) return config.status();
  if (fabric.api == nullptr || !fabric.make_registrar) {
    return sdk::Status(KVB_ERR_INTERNAL, "verbs: no VerbsApi or registrar");
  }
  auto node = host.NodeId();
  auto inc = host.Incarnation();
  if (!node.ok()) return node.status();
  if (!inc.ok()) return inc.status();
  std::unique_ptr<Transport> t(new Transport(host, std::move(*config), std::move(fabric)));
  t->node_id_ = *node;
  t->incarnation_ = *inc;
  t->staging_possible_ = t->config_.host_staging != 0 && host.HasDeviceServices();
  if (auto st = t->OpenNics(); !st.ok()) return st;
  if (auto st = t->Listen(params.listen); !st.ok()) return st;
  t->counters_.wrs_per_nic.assign(t->nics_.size(), 0);
  t->endpoints_text_ = FormatEndpoints(t->endpoints_);
  if (pipe2(t->wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return sdk::Status(KVB_ERR_INTERNAL, std::string("verbs: pipe2: ") + std::strerror(errno));
  }
  Transport* self = t.get();
  t->listener_ = std::thread([self] { self->ListenerLoop(); });
  t->progress_ = std::thread([self] { self->ProgressLoop(); });
  host.Log(KVB_LOG_INFO, "verbs: %zu NIC port(s), side channel on %s:%u", t->nics_.size(),
           t->endpoints_.cm_host.c_str(), t->endpoints_.cm_port);
  return t;
}

sdk::Status Transport::OpenNics() {
  auto found = ReadNics(fabric_.sysfs_root);
  if (!found.ok()) return found.status();
  const std::vector<std::string> allow = SplitList(config_.devices);
  std::string skipped;
  for (const Nic& nic : *found) {
    if (!allow.empty() && std::find(allow.begin(), allow.end(), nic.name) == allow.end()) continue;
    if (!nic.error.empty()) {
      skipped += " " + nic.name + ": " + nic.error + ";";
      continue;
    }
    std::vector<NicPort> active;
    for (const NicPort& p : nic.ports) {
      if (p.active) active.push_back(p);
    }
    if (active.empty()) {
      skipped += " " + nic.name + ": no ACTIVE port;";
      continue;
    }
    auto dev = fabric_.api->OpenDevice(nic.name);
    if (!dev.ok()) {
      skipped += " " + nic.name + ": " + dev.status().message() + ";";
      continue;
    }
    auto pd = fabric_.api->AllocPd(*dev);
    if (!pd.ok()) {
      (void)fabric_.api->CloseDevice(*dev);
      skipped += " " + nic.name + ": " + pd.status().message() + ";";
      continue;
    }
    auto ctx = std::make_unique<DeviceCtx>();
    ctx->name = nic.name;
    ctx->dev = *dev;
    ctx->pd = *pd;
    ctx->qp.max_outstanding = config_.max_outstanding_wr;
    ctx->qp.progress_timeout_ns = config_.progress_timeout_ms * kMsNs;
    if (auto attr = fabric_.api->QueryDevice(*dev); attr.ok()) {
      // ibv_modify_qp refuses read depths past the device's, ibv_create_qp/cq longer queues.
      auto clamp = [](auto v, uint32_t limit) {
        return limit == 0 ? v : static_cast<decltype(v)>(std::min<uint32_t>(v, limit));
      };
      ctx->qp.max_rd_atomic = clamp(ctx->qp.max_rd_atomic, attr->max_qp_init_rd_atom);
      ctx->qp.max_dest_rd_atomic = clamp(ctx->qp.max_dest_rd_atomic, attr->max_qp_rd_atom);
      ctx->qp.max_outstanding =
          clamp(clamp(ctx->qp.max_outstanding, attr->max_qp_wr), attr->max_cqe);
      if (ctx->qp.max_outstanding != config_.max_outstanding_wr ||
          ctx->qp.max_rd_atomic != RcOptions{}.max_rd_atomic) {
        host_.Log(KVB_LOG_INFO,
                  "verbs: %s: QPs of %u work requests, %u/%u RDMA READs (the device's limits)",
                  nic.name.c_str(), ctx->qp.max_outstanding, ctx->qp.max_rd_atomic,
                  ctx->qp.max_dest_rd_atomic);
      }
    }
    ctx->registrar = fabric_.make_registrar(nic.name, *dev, *pd);
    ctx->mrs = std::make_unique<MrCache>(*ctx->registrar, MrCacheLimits{});
    Nic kept = nic;
    kept.ports.clear();
    for (const NicPort& p : active) {
      auto attr = fabric_.api->QueryPort(*dev, static_cast<uint8_t>(p.port));
      if (!attr.ok() || attr->state != PortState::kActive || !ValidMtu(attr->active_mtu)) {
        skipped += " " + nic.name + " port " + std::to_string(p.port) + ": " +
                   (attr.ok() ? "not ACTIVE or no MTU" : attr.status().message()) + ";";
        continue;
      }
      auto nic_entry = std::make_unique<LocalNic>();
      nic_entry->device = devices_.size();
      nic_entry->name = nic.name;
      nic_entry->numa_node = nic.numa_node;
      LocalPortInfo& info = nic_entry->info;
      info.port = static_cast<uint8_t>(p.port);
      info.ethernet = attr->ethernet;
      info.lid = attr->lid;
      info.active_mtu = attr->active_mtu;
      info.gid_index = static_cast<uint8_t>(config_.gid_index);
      if (attr->ethernet || config_.gid_index != 0) {
        auto gid = fabric_.api->QueryGid(*dev, info.port, static_cast<int>(config_.gid_index));
        if (!gid.ok()) {
          skipped += " " + nic.name + " port " + std::to_string(p.port) + ": " +
                     gid.status().message() + ";";
          continue;
        }
        info.gid = *gid;
      }
      if (nics_.size() >= kMaxNics) break;
      endpoints_.nics.push_back(EndpointNic{nic.name, info.port, info.lid, info.gid, info.ethernet,
                                            info.active_mtu, nic.numa_node});
      kept.ports.push_back(p);
      nics_.push_back(std::move(nic_entry));
    }
    if (kept.ports.empty()) {
      ctx->mrs.reset();
      ctx->registrar.reset();
      (void)fabric_.api->DeallocPd(ctx->pd);
      (void)fabric_.api->CloseDevice(ctx->dev);
      continue;
    }
    topology_.push_back(std::move(kept));
    devices_.push_back(std::move(ctx));
  }
  if (nics_.empty()) {
    std::string why = found->empty() ? "no device under " + fabric_.sysfs_root + "/class/infiniband"
                                     : "no usable port:" + skipped;
    if (!allow.empty()) why += " (verbs.devices=" + config_.devices + ")";
    return sdk::Status(KVB_ERR_UNAVAILABLE, "no RDMA device (" + why + ")");
  }
  if (!skipped.empty()) host_.Log(KVB_LOG_INFO, "verbs: left out:%s", skipped.c_str());
  return {};
}

// verbs.cm_listen when set; else the host of the engine's first listen entry with port 0 (its
// port belongs to the tcp transport, which may be loaded too).
sdk::Status Transport::Listen(const char* listen) {
  std::string spec = config_.cm_listen;
  if (spec.empty()) {
    spec = listen != nullptr ? listen : "";
    spec = spec.substr(0, spec.find(','));
    const size_t colon = spec.rfind(':');
    spec =
        (spec.empty() || colon == std::string::npos ? "127.0.0.1" : spec.substr(0, colon)) + ":0";
  }
  const size_t colon = spec.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "verbs: side-channel address '" + spec + "' is not host:port");
  }
  const std::string host = spec.substr(0, colon), port = spec.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "verbs: listen '" + spec + "': " + gai_strerror(rc));
  }
  std::string err;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      endpoints_.cm_port =
          ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      endpoints_.cm_host = host;
      if (host == "0.0.0.0" || host == "::" || host == "[::]") {
        // A wildcard is no address to dial: publish this host's name.
        char name[256] = "";
        if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') endpoints_.cm_host = name;
      }
      listen_fd_ = fd;
      break;
    }
    err = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(res);
  if (listen_fd_ < 0) {
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       "verbs: cannot listen for the side channel on " + spec + ": " + err);
  }
  return {};
}

Transport::~Transport() {
  stop_ = true;
  Wake();
  if (listener_.joinable()) listener_.join();
  if (progress_.joinable()) progress_.join();
  Done done;
  std::vector<std::unique_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Peer* p : peers_) {
      FailPeer(*p, sdk::Status(KVB_ERR_CANCELLED, "verbs: the transport is shutting down"), &done);
      peers.emplace_back(p);
    }
    peers_.clear();
  }
  for (auto& p : peers) {
    if (!p->draining.empty()) DrainAll(*p, &done);
  }
  Run(done);
  for (Orphan& o : orphans_) o.thread.join();
  orphans_.clear();
  for (auto& p : peers) {
    if (p->job_thread.joinable()) p->job_thread.join();
    if (p->job) {
      for (auto& c : p->job->conns) c.reset();
    }
  }
  peers.clear();
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    inbound_.clear();
  }
  regions_.clear();
  for (auto& d : devices_) {
    d->mrs.reset();
    d->registrar.reset();
    (void)fabric_.api->DeallocPd(d->pd);
    (void)fabric_.api->CloseDevice(d->dev);
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  for (int fd : wake_pipe_) {
    if (fd >= 0) close(fd);
  }
}

void Transport::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    work_ = true;
  }
  cv_.notify_all();
  if (wake_pipe_[1] >= 0) {
    const char c = 1;
    (void)!write(wake_pipe_[1], &c, 1);
  }
}

void Transport::Run(Done& done) {
  for (auto& f : done) f();
  done.clear();
}

// ---- side channel: server --------------------------------------------------------------------

void Transport::ListenerLoop() {
  while (!stop_) {
    std::erase_if(exchanges_, [](Exchange& x) {
      if (!x.done->load()) return false;
      x.thread.join();
      close(x.fd);
      return true;
    });
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    const int r = poll(fds, 2, 1000);
    if (r <= 0) continue;
    if (fds[1].revents != 0) {
      char buf[64];
      while (read(wake_pipe_[0], buf, sizeof(buf)) > 0) {
      }
    }
    if ((fds[0].revents & POLLIN) == 0) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    char host[INET6_ADDRSTRLEN] = "?";
    uint16_t port = 0;
    if (ss.ss_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
      port = ntohs(in->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      auto* in = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
      port = ntohs(in->sin6_port);
    }
    const std::string from = std::string(host) + ":" + std::to_string(port);
    if (exchanges_.size() >= config_.max_handshakes) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.frames_rejected;
        ++counters_.side_channel_refused;
      }
      host_.Log(KVB_LOG_WARN,
                "verbs: side channel from %s: %u exchanges in progress (verbs.max_handshakes); "
                "connection closed",
                from.c_str(), config_.max_handshakes);
      close(fd);
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread t([this, fd, from, done] {
      ServeOne(fd, from);
      shutdown(fd, SHUT_RDWR);  // the peer sees the close now; the fd is closed when reaped
      done->store(true);
    });
    exchanges_.push_back(Exchange{fd, std::move(t), done});
  }
  // Shutting down: wake every exchange out of its socket wait, then wait for it.
  for (Exchange& x : exchanges_) shutdown(x.fd, SHUT_RDWR);
  for (Exchange& x : exchanges_) {
    x.thread.join();
    close(x.fd);
  }
  exchanges_.clear();
}

// One side-channel exchange, bounded by connect_timeout_ms: handshake, the client's kConnect,
// this side's QPs to RTS, kAccept. Anything wrong closes the connection with a logged reason.
void Transport::ServeOne(int fd, const std::string& from) {
  const uint64_t deadline = host_.NowNs() + config_.connect_timeout_ms * kMsNs;
  auto reject = [&](const std::string& why) {
    // Logged before counted: whoever sees the count finds the reason in the log.
    host_.Log(KVB_LOG_WARN, "verbs: side channel from %s: %s; connection closed", from.c_str(),
              why.c_str());
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.frames_rejected;
    ++counters_.side_channel_refused;
  };
  auto auth = host_.BeginAuth(KVB_AUTH_SERVER);
  if (!auth.ok()) return reject("handshake: " + auth.status().message());
  if (auto st = RunAuth(host_, fd, *auth, /*client=*/false, deadline); !st.ok()) {
    return reject("handshake refused (" + std::to_string(st.code()) + "): " + st.message());
  }
  auto who = auth->Peer();
  if (!who.ok()) return reject(who.status().message());
  const std::string client = Who(who->node_id, who->incarnation) + " at " + from;
  auto frame = RecvFrame(host_, fd, deadline);
  if (!frame.ok()) return reject(client + ": " + frame.status().message());
  auto refuse = [&](kvb_status_t code, const std::string& why) {
    (void)SendFrame(host_, fd, Frame{FrameType::kRefuse, {}, code, why}, deadline);
    reject(client + ": " + why);
  };
  if (frame->type != FrameType::kConnect) {
    return refuse(KVB_ERR_PROTOCOL, "malformed side-channel frame: expected a connect frame");
  }
  std::set<std::pair<uint8_t, uint8_t>> seen;
  for (const QpInfo& q : frame->qps) {
    if (q.server_nic >= nics_.size() || !seen.insert({q.client_nic, q.server_nic}).second) {
      return refuse(KVB_ERR_PROTOCOL,
                    "malformed side-channel frame: pair (" + std::to_string(q.client_nic) + ", " +
                        std::to_string(q.server_nic) + ") repeated or names no NIC of " +
                        std::to_string(nics_.size()));
    }
  }
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    if (inbound_.size() + frame->qps.size() > config_.max_inbound_qps) {
      return refuse(
          KVB_ERR_BACKPRESSURE,
          "verbs.max_inbound_qps (" + std::to_string(config_.max_inbound_qps) + ") reached");
    }
  }
  Frame reply;
  reply.type = FrameType::kAccept;
  std::vector<std::unique_ptr<RcConnection>> made;
  for (const QpInfo& q : frame->qps) {
    const LocalNic& nic = *nics_[q.server_nic];
    const DeviceCtx& d = *devices_[nic.device];
    RcOptions opts = d.qp;
    opts.progress_timeout_ns = 0;  // it posts nothing
    opts.local_psn = RandomPsn();
    auto conn =
        RcConnection::Create(*fabric_.api, d.dev, d.pd, {who->node_id, who->incarnation}, opts);
    if (!conn.ok()) return refuse(conn.status().code(), conn.status().message());
    RemoteQpInfo remote{who->node_id, who->incarnation, q.qp_num, q.psn, q.lid, q.gid, q.mtu};
    if (auto st = (*conn)->Connect(nic.info, remote); !st.ok()) {
      return refuse(st.code(), st.message());
    }
    reply.qps.push_back(QpInfo{q.client_nic, q.server_nic, (*conn)->qp_num(), opts.local_psn,
                               nic.info.lid, nic.info.gid, nic.info.active_mtu});
    made.push_back(std::move(*conn));
  }
  if (auto st = SendFrame(host_, fd, reply, deadline); !st.ok()) {
    return reject(client + ": " + st.message());
  }
  std::vector<std::unique_ptr<RcConnection>> old;
  std::lock_guard<std::mutex> lock(inbound_mu_);
  // QPs of another incarnation of the same node belong to a process that is gone.
  for (auto it = inbound_.begin(); it != inbound_.end();) {
    if (std::get<0>(it->first) == who->node_id && std::get<1>(it->first) != who->incarnation) {
      old.push_back(std::move(it->second));
      it = inbound_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t i = 0; i < made.size(); ++i) {
    const QpInfo& q = frame->qps[i];
    auto& slot = inbound_[{who->node_id, who->incarnation, q.client_nic, q.server_nic}];
    if (slot) old.push_back(std::move(slot));
    slot = std::move(made[i]);
  }
}

// ---- side channel: client --------------------------------------------------------------------

void Transport::RunConnect(ConnectJob& job) {
  const uint64_t deadline = host_.NowNs() + config_.connect_timeout_ms * kMsNs;
  job.conns.resize(job.pairs.size());
  job.pair_status.resize(job.pairs.size());
  const std::string who = Who(job.peer.node_id, job.peer.incarnation);
  auto finish = [&](sdk::Status st) {
    job.status = std::move(st);
    if (!job.status.ok()) {
      for (auto& c : job.conns) c.reset();
    }
    // Wake before done: once done is seen the thread may be joined under mu_, which Wake takes.
    Wake();
    job.done = true;
  };
  Frame hello;
  hello.type = FrameType::kConnect;
  for (size_t i = 0; i < job.pairs.size(); ++i) {
    const LocalNic& nic = *nics_[job.pairs[i].first];
    const DeviceCtx& d = *devices_[nic.device];
    RcOptions opts = d.qp;
    opts.local_psn = RandomPsn();
    auto conn = RcConnection::Create(*fabric_.api, d.dev, d.pd, job.peer, opts);
    if (!conn.ok()) {
      job.pair_status[i] = conn.status();
      continue;
    }
    hello.qps.push_back(QpInfo{static_cast<uint8_t>(job.pairs[i].first),
                               static_cast<uint8_t>(job.pairs[i].second), (*conn)->qp_num(),
                               opts.local_psn, nic.info.lid, nic.info.gid, nic.info.active_mtu});
    job.conns[i] = std::move(*conn);
  }
  if (hello.qps.empty()) {
    return finish(sdk::Status(KVB_ERR_INTERNAL, "verbs: no QP could be created for " + who));
  }

  const std::string where = job.host + ":" + std::to_string(job.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(job.host.c_str(), std::to_string(job.port).c_str(), &hints, &res);
      rc != 0) {
    return finish(sdk::Status(KVB_ERR_PEER_UNREACHABLE, "verbs: side channel " + where + " of " +
                                                            who + ": " + gai_strerror(rc)));
  }
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    int soerr = errno;
    if (soerr == EINPROGRESS && WaitFd(host_, fd, POLLOUT, deadline)) {
      socklen_t l = sizeof(soerr);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &l);
      if (soerr == 0) break;
    } else if (soerr == EINPROGRESS) {
      soerr = ETIMEDOUT;
    }
    err = std::strerror(soerr);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    return finish(sdk::Status(KVB_ERR_PEER_UNREACHABLE, "verbs: cannot reach the side channel " +
                                                            where + " of " + who + ": " + err));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};

  auto auth = host_.BeginAuth(KVB_AUTH_CLIENT, job.peer.node_id, job.peer.incarnation);
  if (!auth.ok()) return finish(auth.status());
  if (auto st = RunAuth(host_, fd, *auth, /*client=*/true, deadline); !st.ok()) {
    return finish(sdk::Status(
        st.code(), "verbs: side channel " + where + " of " + who + ": handshake: " + st.message()));
  }
  auto peer = auth->Peer();
  if (!peer.ok()) return finish(peer.status());
  if (peer->node_id != job.peer.node_id || peer->incarnation != job.peer.incarnation) {
    return finish(sdk::Status(KVB_ERR_STALE_PEER, "verbs: side channel " + where + " answered as " +
                                                      Who(peer->node_id, peer->incarnation) +
                                                      ", not " + who));
  }
  if (auto st = SendFrame(host_, fd, hello, deadline); !st.ok()) {
    return finish(sdk::Status(st.code(), "verbs: " + who + ": " + st.message()));
  }
  auto reply = RecvFrame(host_, fd, deadline);
  if (!reply.ok()) {
    return finish(sdk::Status(reply.status().code(), "verbs: side channel " + where + " of " + who +
                                                         ": " + reply.status().message()));
  }
  if (reply->type == FrameType::kRefuse) {
    return finish(
        sdk::Status(reply->code, "verbs: " + who + " refused the connection: " + reply->reason));
  }
  if (reply->type != FrameType::kAccept) {
    return finish(
        sdk::Status(KVB_ERR_PROTOCOL, "verbs: " + who + " answered with a connect frame"));
  }
  for (size_t i = 0; i < job.pairs.size(); ++i) {
    if (!job.conns[i]) continue;
    const QpInfo* match = nullptr;
    for (const QpInfo& q : reply->qps) {
      if (q.client_nic == job.pairs[i].first && q.server_nic == job.pairs[i].second) match = &q;
    }
    sdk::Status st;
    if (match == nullptr) {
      st = sdk::Status(KVB_ERR_PROTOCOL, "verbs: " + who + " accepted without a QP for NIC pair " +
                                             std::to_string(job.pairs[i].first) + "/" +
                                             std::to_string(job.pairs[i].second));
    } else {
      RemoteQpInfo remote{peer->node_id, peer->incarnation, match->qp_num, match->psn,
                          match->lid,    match->gid,        match->mtu};
      st = job.conns[i]->Connect(nics_[job.pairs[i].first]->info, remote);
    }
    if (!st.ok()) {
      job.pair_status[i] = st;
      job.conns[i].reset();
    }
  }
  finish(sdk::Status());
}

// ---- registration ----------------------------------------------------------------------------

sdk::Status Transport::RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer& key) {
  const bool cuda = r.mem_kind == KVB_MEM_CUDA;
  if (r.addr == nullptr || r.length == 0 || (r.mem_kind != KVB_MEM_HOST && !cuda)) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "verbs: register_memory: NULL address, length 0 or unknown memory kind");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count(r.segment_id) != 0) {
      return sdk::Status(KVB_ERR_ALREADY_EXISTS,
                         "verbs: segment " + std::to_string(r.segment_id) + " is registered");
    }
  }
  if (cuda && !fabric_.cuda_direct) {
    return RegisterStaged(r, "neither dma-buf nor nvidia-peermem is available here");
  }
  auto region = std::make_unique<Region>();
  region->addr = reinterpret_cast<uint64_t>(r.addr);
  region->length = r.length;
  region->cuda = cuda;
  region->device_id = cuda ? r.device_id : -1;
  for (auto& d : devices_) {
    auto ref = d->mrs->Acquire(region->addr, r.length, cuda, r.device_id);
    if (!ref.ok()) {
      const std::string why = "registering segment " + std::to_string(r.segment_id) + " on " +
                              d->name + ": " + ref.status().message();
      if (cuda && ref.status().code() == KVB_ERR_UNSUPPORTED) {
        // Staged instead: the MRs made on the devices before this one go.
        region->mrs.clear();
        for (auto& prev : devices_) {
          if (prev.get() == d.get()) break;
          prev->mrs->Invalidate(region->addr, r.length);
        }
        return RegisterStaged(r, why);
      }
      return sdk::Status(ref.status().code(), "verbs: " + why);
    }
    host_.Log(KVB_LOG_DEBUG,
              "verbs: segment %" PRIu64 " (%" PRIu64 " bytes of %s memory) on %s: %s", r.segment_id,
              r.length, cuda ? "CUDA" : "host", d->name.c_str(), RegPathName(ref->path()));
    region->mrs.push_back(std::move(*ref));
  }
  std::vector<RegionKey> keys;
  for (const auto& nic : nics_) {
    keys.push_back(RegionKey{region->mrs[nic->device].rkey(), region->addr});
  }
  // The closest rails: those ChooseRails puts at the smallest distance from the memory.
  Location where;
  if (fabric_.locate) {
    where = fabric_.locate(region->addr, cuda, r.device_id);
  } else if (!cuda) {
    where.numa_node = HostNumaNodeOf(region->addr);
  }
  std::vector<std::string> gpu_path;
  if (!where.gpu_pci.empty()) {
    auto path = PciPathOf(fabric_.sysfs_root, where.gpu_pci);
    if (path.ok()) gpu_path = std::move(*path);
  }
  auto rails = ChooseRails(topology_, where, gpu_path, config_.max_rails, {});
  if (rails.ok()) {
    for (const Rail& rail : *rails) {
      if (rail.distance != rails->front().distance) break;
      for (uint32_t i = 0; i < nics_.size(); ++i) {
        if (nics_[i]->name == rail.device && nics_[i]->info.port == rail.port) {
          region->rails.push_back(i);
        }
      }
    }
  }
  if (region->rails.empty()) {
    for (uint32_t i = 0; i < nics_.size(); ++i) region->rails.push_back(i);
  }
  std::string names;
  for (uint32_t i : region->rails) {
    names += " " + nics_[i]->name + ":" + std::to_string(nics_[i]->info.port);
  }
  host_.Log(KVB_LOG_DEBUG, "verbs: segment %" PRIu64 " (NUMA node %d%s%s) uses rails%s",
            r.segment_id, where.numa_node, where.gpu_pci.empty() ? "" : ", GPU ",
            where.gpu_pci.c_str(), names.c_str());
  const std::vector<uint8_t> blob = EncodeRkeys(keys);
  if (auto st = key.Set(sdk::Bytes(blob)); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(mu_);
  for (const MrRef& m : region->mrs) ++counters_.registrations[static_cast<size_t>(m.path())];
  if (cuda) ++stats_.device_regions_direct;
  regions_[r.segment_id] = std::move(region);
  return {};
}

sdk::Status Transport::DeregisterMemory(uint64_t segment_id) {
  std::unique_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(segment_id);
    if (it == regions_.end()) {
      return sdk::Status(KVB_ERR_NOT_FOUND,
                         "verbs: segment " + std::to_string(segment_id) + " is not registered");
    }
    region = std::move(it->second);
    regions_.erase(it);
  }
  if (region->staged) return {};  // no MRs: its bytes only ever passed through bounce buffers
  for (size_t i = 0; i < devices_.size(); ++i) {
    region->mrs[i].Release();
    devices_[i]->mrs->Invalidate(region->addr, region->length);
  }
  return {};
}

sdk::Status Transport::RegisterStaged(const sdk::Region& r, const std::string& why_direct) {
  const std::string seg = "verbs: segment " + std::to_string(r.segment_id) + " (CUDA memory)";
  if (!staging_possible_) {
    return sdk::Status(KVB_ERR_UNSUPPORTED,
                       seg + ": no GPUDirect path (" + why_direct + ") and host staging is " +
                           (config_.host_staging == 0 ? "off (verbs.host_staging=0)"
                                                      : "impossible: the host offers no device "
                                                        "services (dev_copy_*, pinned_alloc)"));
  }
  if (!r.CanBeLocalOnly()) {
    return sdk::Status(KVB_ERR_UNSUPPORTED,
                       seg + ": no GPUDirect path (" + why_direct +
                           "), and host staging needs a host that keeps the region's key local "
                           "(kvb_region_t.reg_flags, ABI 1.5)");
  }
  auto region = std::make_unique<Region>();
  region->addr = reinterpret_cast<uint64_t>(r.addr);
  region->length = r.length;
  region->cuda = true;
  region->staged = true;
  region->device_id = r.device_id;
  for (uint32_t i = 0; i < nics_.size(); ++i) region->rails.push_back(i);
  r.MarkLocalOnly();
  host_.Log(KVB_LOG_INFO,
            "%s, %" PRIu64
            " bytes on device %d: host staging (%s); peers reach it over "
            "another transport",
            seg.c_str(), r.length, r.device_id, why_direct.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.registrations[static_cast<size_t>(RegPath::kHostStaging)];
  ++stats_.device_regions_staged;
  regions_[r.segment_id] = std::move(region);
  return {};
}

// ---- peers -----------------------------------------------------------------------------------

namespace {

sdk::Status ReadPeer(const sdk::PeerInfo& info, Endpoints* ep,
                     std::unordered_map<uint64_t, RemoteSegment>* segments) {
  if (info.node_id.empty())
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "verbs: peer without node id");
  auto parsed = ParseEndpoints(info.endpoints);
  if (!parsed.ok()) return parsed.status();
  for (const sdk::PeerSegment& s : info.segments) {
    auto keys = DecodeRkeys(s.rkey);
    if (!keys.ok()) {
      return sdk::Status(
          KVB_ERR_INVALID_ARGUMENT,
          "verbs: segment " + std::to_string(s.segment_id) + ": " + keys.status().message());
    }
    if (keys->size() != parsed->nics.size()) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                         "verbs: segment " + std::to_string(s.segment_id) + " has rkeys for " +
                             std::to_string(keys->size()) + " NICs, the endpoints list " +
                             std::to_string(parsed->nics.size()));
    }
    (*segments)[s.segment_id] = RemoteSegment{s.length, std::move(*keys)};
  }
  *ep = std::move(*parsed);
  return {};
}

}  // namespace

sdk::Result<Peer*> Transport::AddPeer(const sdk::PeerInfo& info) {
  auto p = std::make_unique<Peer>();
  p->node_id = std::string(info.node_id);
  p->incarnation = info.incarnation;
  if (auto st = ReadPeer(info, &p->ep, &p->segments); !st.ok()) return st;
  p->rails.resize(nics_.size());
  for (uint32_t i = 0; i < nics_.size(); ++i) {
    p->rails[i].remote_nic = i % static_cast<uint32_t>(p->ep.nics.size());
  }
  std::lock_guard<std::mutex> lock(mu_);
  Peer* raw = p.release();
  peers_.insert(raw);
  return raw;
}

sdk::Status Transport::UpdatePeer(Peer* peer, const sdk::PeerInfo& info) {
  if (peer == nullptr)
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "verbs: update_peer: NULL peer");
  if (info.node_id != peer->node_id || info.incarnation != peer->incarnation) {
    return sdk::Status(KVB_ERR_STALE_PEER,
                       "verbs: update_peer: " + Who(std::string(info.node_id), info.incarnation) +
                           " is not " + Who(peer->node_id, peer->incarnation));
  }
  verbs::Endpoints ep;
  std::unordered_map<uint64_t, RemoteSegment> segments;
  if (auto st = ReadPeer(info, &ep, &segments); !st.ok()) return st;
  Done done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool moved = ep.cm_host != peer->ep.cm_host || ep.cm_port != peer->ep.cm_port ||
                       ep.nics.size() != peer->ep.nics.size();
    peer->segments = std::move(segments);
    peer->ep = std::move(ep);
    if (moved) {
      const uint64_t now = host_.NowNs();
      for (uint32_t i = 0; i < peer->rails.size(); ++i) {
        if (peer->rails[i].conn) {
          FailRail(*peer, i, sdk::Status(KVB_ERR_CANCELLED, "the peer's endpoints changed"), now,
                   &done);
        }
        peer->rails[i].retry_at_ns = 0;
        peer->rails[i].remote_nic = i % static_cast<uint32_t>(peer->ep.nics.size());
      }
    }
  }
  Run(done);
  return {};
}

void Transport::RemovePeer(Peer* peer) {
  if (peer == nullptr) return;
  Done done;
  std::unique_ptr<Peer> owned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.erase(peer) == 0) return;
    FailPeer(*peer, sdk::Status(KVB_ERR_CANCELLED, "verbs: the peer was removed"), &done);
    owned.reset(peer);
    // A connect in progress may take up to connect_timeout_ms: the progress thread joins it
    // once done, so the caller does not wait for a dead peer.
    if (owned->job_thread.joinable()) {
      orphans_.push_back(Orphan{std::move(owned->job_thread), owned->job});
    }
  }
  // Its ring and copy queues go with it: its requests' running device copies end first.
  if (!owned->draining.empty()) DrainAll(*owned, &done);
  Run(done);
}

// ---- posting ---------------------------------------------------------------------------------

sdk::Result<Request*> Transport::Post(Peer* peer, const sdk::Ops& ops,
                                      const sdk::PostOptions& opts) {
  if (peer == nullptr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "verbs: post: NULL peer");
  auto req = std::make_unique<Request>();
  req->deadline_ns = opts.deadline_ns;
  req->progress_timeout_ns = opts.progress_timeout_ns != 0 ? opts.progress_timeout_ns
                                                           : config_.progress_timeout_ms * kMsNs;
  req->on_complete = opts.on_complete;
  req->user = opts.user;
  req->ops.resize(ops.size());
  req->rails.resize(ops.size());
  // A staged op needs the peer's staging ring. It is made without mu_ (pinned memory and its
  // registration on every NIC take milliseconds), so neither the progress thread nor other
  // posts wait for it; one made by a concurrent post first goes unused (freed on return, after
  // mu_ is released).
  std::unique_ptr<StagingRing> ring;
  {
    std::string who;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (peers_.count(peer) != 0 && peer->staging == nullptr) {
        for (uint32_t i = 0; i < ops.size() && who.empty(); ++i) {
          auto it = regions_.find(ops[i].local_segment);
          if (it != regions_.end() && it->second->staged)
            who = Who(peer->node_id, peer->incarnation);
        }
      }
    }
    if (!who.empty()) {
      auto made = MakeStagingRing(who);
      if (!made.ok()) return made.status();
      ring = std::move(*made);
    }
  }
  Done done;
  std::unique_lock<std::mutex> lock(mu_);
  if (peers_.count(peer) == 0) return sdk::Status(KVB_ERR_NOT_FOUND, "verbs: post: unknown peer");
  if (!peer->fatal.ok()) return peer->fatal;
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < ops.size(); ++i) {
    const kvb_xfer_op_t op = ops[i];
    const std::string what = "verbs: op " + std::to_string(i) + ": ";
    if (op.opcode != KVB_OP_READ && op.opcode != KVB_OP_WRITE) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, what + "opcode is neither READ nor WRITE");
    }
    if (op.length == 0 || op.local_addr == nullptr) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, what + "length 0 or NULL local address");
    }
    auto local = regions_.find(op.local_segment);
    const uint64_t la = reinterpret_cast<uint64_t>(op.local_addr);
    if (local == regions_.end() || la < local->second->addr ||
        la - local->second->addr > local->second->length ||
        op.length > local->second->length - (la - local->second->addr)) {
      return sdk::Status(
          KVB_ERR_NOT_REGISTERED,
          what + "local memory is not inside local segment " + std::to_string(op.local_segment));
    }
    auto remote = peer->segments.find(op.remote_segment);
    if (remote == peer->segments.end()) {
      return sdk::Status(KVB_ERR_NOT_REGISTERED,
                         what + "segment " + std::to_string(op.remote_segment) +
                             " is not registered at " + Who(peer->node_id, peer->incarnation));
    }
    if (op.remote_offset > remote->second.length ||
        op.length > remote->second.length - op.remote_offset) {
      return sdk::Status(KVB_ERR_OUT_OF_BOUNDS,
                         what + "[" + std::to_string(op.remote_offset) + ", +" +
                             std::to_string(op.length) + ") is outside segment " +
                             std::to_string(op.remote_segment) + " of " +
                             std::to_string(remote->second.length) + " bytes");
    }
    if (local->second->staged && peer->staging == nullptr) {
      if (ring == nullptr) {  // the region was registered since the first look: made here
        auto made = MakeStagingRing(Who(peer->node_id, peer->incarnation));
        if (!made.ok()) return made.status();
        ring = std::move(*made);
      }
      peer->staging = std::move(ring);
      ++counters_.staging_rings;
    }
    bytes += op.length;
    req->rails[i] = local->second->rails;
    if (config_.max_rails != 0 && req->rails[i].size() > config_.max_rails) {
      req->rails[i].resize(config_.max_rails);
    }
  }
  if (peer->queued_bytes + bytes > config_.max_queued_bytes_per_peer ||
      peer->queued_ops + ops.size() > config_.max_queued_ops_per_peer) {
    return sdk::Status(KVB_ERR_BACKPRESSURE, "verbs: " + Who(peer->node_id, peer->incarnation) +
                                                 " has " + std::to_string(peer->queued_bytes) +
                                                 " bytes in " + std::to_string(peer->queued_ops) +
                                                 " ops queued; " + std::to_string(bytes) +
                                                 " more would pass verbs.max_queued_bytes_"
                                                 "per_peer (" +
                                                 std::to_string(config_.max_queued_bytes_per_peer) +
                                                 ") or verbs.max_queued_ops_per_peer (" +
                                                 std::to_string(config_.max_queued_ops_per_peer) +
                                                 ")");
  }
  Request* r = requests_.Adopt(std::move(req));
  r->peer = peer;
  r->charged_bytes = bytes;
  r->charged_ops = ops.size();
  r->last_progress_ns = host_.NowNs();
  peer->queued_bytes += bytes;
  peer->queued_ops += ops.size();
  stats_.queued_bytes += bytes;
  peer->requests.insert(r);
  for (uint32_t i = 0; i < ops.size(); ++i) {
    const kvb_xfer_op_t op = ops[i];
    const auto& rails = r->rails[i];
    const Region& local = *regions_.at(op.local_segment);
    // A staged op's work requests each fit one bounce buffer.
    const uint64_t wr_bytes = local.staged
                                  ? std::min(config_.max_wr_bytes, config_.staging_buffer_bytes)
                                  : config_.max_wr_bytes;
    const std::vector<Stripe> stripes =
        PlanStripes(op.length, static_cast<uint32_t>(rails.size()), config_.stripe_min_bytes);
    for (const Stripe& st : stripes) {
      for (uint64_t off = 0; off < st.length; off += wr_bytes) {
        auto s = std::make_unique<Slice>();
        s->req = r;
        s->op = i;
        s->opcode = op.opcode == KVB_OP_READ ? WrOpcode::kRdmaRead : WrOpcode::kRdmaWrite;
        s->local_addr = reinterpret_cast<uint64_t>(op.local_addr) + st.offset + off;
        s->local_segment = op.local_segment;
        s->remote_segment = op.remote_segment;
        s->remote_offset = op.remote_offset + st.offset + off;
        s->length = static_cast<uint32_t>(std::min<uint64_t>(wr_bytes, st.length - off));
        s->staged = local.staged;
        s->device = local.device_id;
        s->rail = rails[st.rail];
        s->allowed = &r->rails[i];
        peer->queue.push_back(s.get());
        ++r->ops[i].left;
        r->slices.push_back(std::move(s));
      }
    }
  }
  r->slices_left = r->slices.size();
  if (r->slices.empty()) Finalize(*r, &done);
  work_ = true;
  lock.unlock();
  cv_.notify_all();
  Run(done);
  return r;
}

sdk::Status Transport::Poll(Request* r, std::span<kvb_status_t> op_status) {
  if (r == nullptr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "verbs: poll: NULL request");
  std::lock_guard<std::mutex> lock(mu_);
  const bool final = r->final && r->reported.load();
  for (size_t i = 0; i < op_status.size() && i < r->ops.size(); ++i) {
    op_status[i] = final ? r->ops[i].code
                         : (r->ops[i].code == KVB_IN_PROGRESS ? KVB_IN_PROGRESS : r->ops[i].code);
  }
  if (!final) return sdk::Status(KVB_IN_PROGRESS);
  for (const OpState& o : r->ops) {
    if (o.code != KVB_OK) return sdk::Status(o.code, o.msg);
  }
  return {};
}

void Transport::Cancel(Request* r) {
  if (r == nullptr) return;
  Done done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!r->final) FailRequest(*r, sdk::Status(KVB_ERR_CANCELLED, "verbs: cancelled"), &done);
  }
  Run(done);
  // Final only once on_complete returned: on another thread, or on the progress thread once
  // the request's running device copies ended (DrainCopies); no lock is held meanwhile.
  for (uint32_t spins = 0; !r->reported.load(); ++spins) {
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void Transport::Release(Request* r) { requests_.Free(r); }

// ---- the progress thread ---------------------------------------------------------------------

void Transport::ProgressLoop() {
  while (!stop_) {
    Done done;
    bool busy = false;
    std::vector<Orphan> finished;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_ = false;
      const uint64_t now = host_.NowNs();
      for (auto it = orphans_.begin(); it != orphans_.end();) {
        // No job: FinishConnect already took it, so the thread has ended or is ending.
        if (it->job == nullptr || it->job->done) {
          finished.push_back(std::move(*it));
          it = orphans_.erase(it);
        } else {
          busy = true;
          ++it;
        }
      }
      for (Peer* p : peers_) {
        PumpPeer(*p, now, &done);
        busy = busy || !p->requests.empty() || p->job != nullptr;
      }
      if (!busy && done.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return work_ || stop_.load(); });
      }
    }
    Run(done);
    for (Orphan& o : finished) o.thread.join();
    if (busy) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Transport::PumpPeer(Peer& p, uint64_t now, Done* done) {
  if (p.job != nullptr && p.job->done) FinishConnect(p, now, done);
  std::vector<OpEnd> ends;
  for (uint32_t i = 0; i < p.rails.size(); ++i) {
    RailConn& rail = p.rails[i];
    if (!rail.conn) continue;
    ends.clear();
    rail.conn->Poll(now, &ends);
    HandleEnds(p, i, ends, now, done);
    if (rail.conn && rail.conn->state() == RcState::kError) {
      FailRail(p, i, rail.conn->first_error(), now, done);
    }
  }
  if (!p.copying_out.empty()) PollCopiesOut(p, now, done);
  if (!p.draining.empty()) DrainCopies(p, now, done);
  // Request deadlines and progress timeouts (posted work also has its own, in RcConnection).
  std::vector<Request*> late;
  for (Request* r : p.requests) {
    if (r->deadline_ns != 0 && now >= r->deadline_ns) {
      late.push_back(r);
    } else if (r->progress_timeout_ns != 0 && now - r->last_progress_ns >= r->progress_timeout_ns) {
      late.push_back(r);
    }
  }
  for (Request* r : late) {
    if (r->Closed()) continue;
    const bool deadline = r->deadline_ns != 0 && now >= r->deadline_ns;
    FailRequest(
        *r,
        deadline
            ? sdk::Status(KVB_ERR_DEADLINE_EXCEEDED,
                          "verbs: the deadline passed " +
                              std::to_string((now - r->deadline_ns) / 1000) +
                              " us ago with work unfinished for " + Who(p.node_id, p.incarnation))
            : sdk::Status(KVB_ERR_PROGRESS_TIMEOUT,
                          "verbs: no progress to " + Who(p.node_id, p.incarnation) + " for " +
                              std::to_string((now - r->last_progress_ns) / kMsNs) +
                              " ms (progress timeout " +
                              std::to_string(r->progress_timeout_ns / kMsNs) + " ms)"),
        done);
  }
  if (p.queue.empty()) return;
  if (p.job == nullptr) StartConnect(p, now);

  // Post what the rails can take; leave the rest queued.
  std::deque<Slice*> keep;
  while (!p.queue.empty()) {
    Slice* s = p.queue.front();
    p.queue.pop_front();
    if (s->ended) continue;
    if (s->staged && !StageReady(p, *s, now, done)) {
      if (!s->ended) keep.push_back(s);
      continue;
    }
    auto usable = [&](uint32_t i) {
      const RailConn& rc = p.rails[i];
      return rc.conn && rc.conn->state() == RcState::kRts &&
             rc.conn->outstanding() < devices_[nics_[i]->device]->qp.max_outstanding;
    };
    auto pending = [&](uint32_t i) {
      const RailConn& rc = p.rails[i];
      return rc.connecting || (!rc.conn && !rc.port_down && rc.retry_at_ns <= now) ||
             (rc.conn && rc.conn->state() == RcState::kRts);
    };
    int32_t chosen = -1;
    if (usable(s->rail)) {
      chosen = static_cast<int32_t>(s->rail);
    } else if (!pending(s->rail)) {
      size_t best = SIZE_MAX;
      for (uint32_t i : *s->allowed) {
        if (usable(i) && p.rails[i].conn->outstanding() < best) {
          best = p.rails[i].conn->outstanding();
          chosen = static_cast<int32_t>(i);
        }
      }
      if (chosen < 0) {
        bool any = false;
        for (uint32_t i : *s->allowed) any = any || pending(i);
        if (!any) {
          std::string why;
          for (uint32_t i : *s->allowed) {
            why += " " + nics_[i]->name + ":" + std::to_string(nics_[i]->info.port) + " (" +
                   p.rails[i].why + ")";
          }
          EndSlice(
              *s,
              sdk::Status(KVB_ERR_PEER_UNREACHABLE,
                          "verbs: no rail left to " + Who(p.node_id, p.incarnation) + ":" + why),
              done);
          continue;
        }
      }
    }
    if (chosen < 0) {
      keep.push_back(s);
      continue;
    }
    auto local = regions_.find(s->local_segment);
    auto remote = p.segments.find(s->remote_segment);
    if (local == regions_.end() || remote == p.segments.end()) {
      EndSlice(*s,
               sdk::Status(KVB_ERR_NOT_REGISTERED,
                           "verbs: segment " +
                               std::to_string(local == regions_.end() ? s->local_segment
                                                                      : s->remote_segment) +
                               " was deregistered before the op was posted"),
               done);
      continue;
    }
    const uint32_t rail = static_cast<uint32_t>(chosen);
    const RegionKey& rk = remote->second.keys[p.rails[rail].remote_nic];
    RdmaOp op;
    op.cookie = reinterpret_cast<uint64_t>(s);
    op.opcode = s->opcode;
    if (s->staged) {
      op.local_addr = reinterpret_cast<uint64_t>(p.staging->buffer(s->bounce));
      op.lkey = p.staging->mrs[nics_[rail]->device].lkey();
    } else {
      op.local_addr = s->local_addr;
      op.lkey = local->second->mrs[nics_[rail]->device].lkey();
    }
    op.remote_addr = rk.base + s->remote_offset;
    op.rkey = rk.rkey;
    op.length = s->length;
    op.deadline_ns = s->req->deadline_ns;
    size_t accepted = 0;
    const sdk::Status st =
        p.rails[rail].conn->Post(std::span<const RdmaOp>(&op, 1), now, &accepted);
    if (accepted == 1) {
      if (s->tries > 0 || rail != s->rail) ++counters_.wrs_retried;
      s->posted = true;
      s->posted_rail = rail;
      ++counters_.wrs_per_nic[rail];
    } else if (st.code() == KVB_ERR_BACKPRESSURE) {
      keep.push_back(s);
    } else {
      keep.push_back(s);  // the rail is failed below; the slice goes elsewhere
    }
  }
  p.queue = std::move(keep);
}

void Transport::StartConnect(Peer& p, uint64_t now) {
  std::set<uint32_t> needed;
  for (Slice* s : p.queue) {
    for (uint32_t i : *s->allowed) needed.insert(i);
  }
  auto job = std::make_shared<ConnectJob>();
  for (uint32_t i : needed) {
    RailConn& rc = p.rails[i];
    if (rc.conn || rc.connecting || rc.retry_at_ns > now) continue;
    const LocalNic& nic = *nics_[i];
    auto attr = fabric_.api->QueryPort(devices_[nic.device]->dev, nic.info.port);
    if (!attr.ok() || attr->state != PortState::kActive) {
      rc.why = attr.ok()
                   ? "port " + std::to_string(nic.info.port) + " of " + nic.name + " is not ACTIVE"
                   : attr.status().message();
      // Asked again after rail_retry_ms (at least 1 ms); no op waits for it meanwhile.
      rc.retry_at_ns = now + std::max<uint64_t>(config_.rail_retry_ms, 1) * kMsNs;
      if (!rc.port_down) {
        ++counters_.rails_failed;
        host_.Log(KVB_LOG_WARN, "verbs: rail %s:%u out: %s", nic.name.c_str(), nic.info.port,
                  rc.why.c_str());
      }
      rc.port_down = true;
      continue;
    }
    rc.port_down = false;
    rc.connecting = true;
    job->pairs.emplace_back(i, rc.remote_nic);
  }
  if (job->pairs.empty()) return;
  if (p.job_thread.joinable()) p.job_thread.join();
  job->host = p.ep.cm_host;
  job->port = p.ep.cm_port;
  job->peer = PeerIncarnation{p.node_id, p.incarnation};
  job->remote_nics = p.ep.nics;
  p.job = job;
  p.job_thread = std::thread([this, job] { RunConnect(*job); });
}

void Transport::FinishConnect(Peer& p, uint64_t now, Done* done) {
  std::shared_ptr<ConnectJob> job = std::move(p.job);
  p.job.reset();
  for (size_t i = 0; i < job->pairs.size(); ++i) {
    RailConn& rc = p.rails[job->pairs[i].first];
    rc.connecting = false;
    if (job->status.ok() && job->conns[i]) {
      rc.conn = std::move(job->conns[i]);
      rc.why.clear();
      ++stats_.connections_opened;
      ++stats_.connections_open;
      continue;
    }
    rc.why = job->status.ok() ? job->pair_status[i].message() : job->status.message();
    rc.retry_at_ns = now + config_.rail_retry_ms * kMsNs;
    ++counters_.rails_failed;
  }
  const kvb_status_t code = job->status.code();
  if (code == KVB_ERR_STALE_PEER || code == KVB_ERR_UNAUTHENTICATED) {
    host_.Log(KVB_LOG_WARN, "%s", job->status.message().c_str());
    FailPeer(p, job->status, done);
  } else if (!job->status.ok()) {
    host_.Log(KVB_LOG_WARN, "%s", job->status.message().c_str());
  }
}

void Transport::HandleEnds(Peer& p, uint32_t rail, std::vector<OpEnd>& ends, uint64_t now,
                           Done* done) {
  (void)rail;
  for (OpEnd& e : ends) {
    auto* s = reinterpret_cast<Slice*>(e.cookie);
    s->posted = false;
    if (s->ended) continue;
    Request& r = *s->req;
    if (e.status.ok()) {
      r.last_progress_ns = now;
      if (s->opcode == WrOpcode::kRdmaRead) {
        stats_.bytes_read += s->length;
      } else {
        stats_.bytes_written += s->length;
      }
      // A staged READ ends when its bytes are in device memory; not copied for a request
      // that is failing (FailRequest closes its rails first).
      if (s->staged && s->opcode == WrOpcode::kRdmaRead && !r.Closed()) {
        StartCopyOut(p, *s, done);
        continue;
      }
      EndSlice(*s, e.status, done);
      continue;
    }
    if (!r.Closed() && IsRetryable(e) && (r.deadline_ns == 0 || now < r.deadline_ns)) {
      ++s->tries;
      p.queue.push_front(s);
      continue;
    }
    EndSlice(*s, e.status, done);
  }
}

// `why` by value: it may be the first_error() of the connection closed here.
void Transport::FailRail(Peer& p, uint32_t i, sdk::Status why, uint64_t now, Done* done) {
  RailConn& rc = p.rails[i];
  if (!rc.conn) return;
  std::vector<OpEnd> ends;
  (void)rc.conn->Close(&ends);
  rc.conn.reset();
  rc.why = why.message();
  rc.retry_at_ns = now + config_.rail_retry_ms * kMsNs;
  ++stats_.connections_evicted;
  --stats_.connections_open;
  ++counters_.rails_failed;
  if (why.code() != KVB_ERR_CANCELLED) {
    host_.Log(KVB_LOG_WARN, "verbs: rail %s:%u to %s evicted: %s", nics_[i]->name.c_str(),
              nics_[i]->info.port, Who(p.node_id, p.incarnation).c_str(), why.message().c_str());
  }
  HandleEnds(p, i, ends, now, done);
}

void Transport::FailPeer(Peer& p, const sdk::Status& why, Done* done) {
  if (why.code() == KVB_ERR_STALE_PEER || why.code() == KVB_ERR_UNAUTHENTICATED) p.fatal = why;
  const std::vector<Request*> reqs(p.requests.begin(), p.requests.end());
  for (Request* r : reqs) {
    if (!r->Closed()) FailRequest(*r, why, done);
  }
  const uint64_t now = host_.NowNs();
  for (uint32_t i = 0; i < p.rails.size(); ++i) FailRail(p, i, why, now, done);
  p.queue.clear();
}

void Transport::EndSlice(Slice& s, const sdk::Status& st, Done* done) {
  if (s.ended) return;
  s.ended = true;
  DropBounce(s);
  Request& r = *s.req;
  OpState& op = r.ops[s.op];
  if (!st.ok() && op.first_error.ok()) op.first_error = st;
  if (--op.left == 0 && op.code == KVB_IN_PROGRESS) {
    op.code = op.first_error.code();
    op.msg = op.first_error.message();
  }
  if (--r.slices_left == 0) Finalize(r, done);
}

void Transport::FailRequest(Request& r, const sdk::Status& why, Done* done) {
  if (r.Closed()) return;
  Peer& p = *r.peer;
  for (OpState& op : r.ops) {
    if (op.code == KVB_IN_PROGRESS) {
      op.code = why.code();
      op.msg = why.message();
    }
  }
  r.final = true;  // HandleEnds must not requeue its slices
  // A posted work request cannot be withdrawn: its QP is closed so the NIC stops touching the
  // request's memory (the rail's other work is retried elsewhere).
  std::set<uint32_t> rails;
  for (auto& s : r.slices) {
    if (s->posted && !s->ended) rails.insert(s->posted_rail);
  }
  const uint64_t now = host_.NowNs();
  for (uint32_t i : rails) FailRail(p, i, why, now, done);
  for (auto& s : r.slices) {
    s->ended = true;
    if (s->bounce >= 0 && s->copy != Slice::Copy::kNone) {
      // Its device copy still uses the bounce buffer and the op's device memory: the request
      // becomes final once that copy ended (DrainCopies), and nobody waits for it here, under
      // mu_ (a copy that never returns would stall every peer of this instance).
      p.draining.push_back(s.get());
      ++r.draining;
    } else {
      DropBounce(*s);
    }
  }
  std::erase_if(p.queue, [&](Slice* s) { return s->req == &r; });
  std::erase_if(p.copying_out, [&](Slice* s) { return s->req == &r; });
  r.slices_left = 0;
  r.final = false;
  if (r.draining == 0) Finalize(r, done);
}

void Transport::DrainCopies(Peer& p, uint64_t now, Done* done) {
  std::vector<Slice*> still;
  std::vector<Slice*> ended;
  for (Slice* s : p.draining) {
    if (p.staging->streams.at(s->device).Done(s->ticket).code() == KVB_IN_PROGRESS) {
      still.push_back(s);
    } else {
      ended.push_back(s);
    }
  }
  p.draining = std::move(still);
  for (Slice* s : ended) EndDrain(*s, done);
  const uint64_t every = uint64_t(config_.progress_timeout_ms) * kMsNs;
  if (!p.draining.empty() && now - p.drain_warned_ns >= every) {
    if (p.drain_warned_ns != 0) {
      host_.Log(KVB_LOG_WARN,
                "verbs: %zu staging copies of failed requests to %s still run after %u ms; "
                "those requests end when they do, other work goes on",
                p.draining.size(), Who(p.node_id, p.incarnation).c_str(),
                config_.progress_timeout_ms);
    }
    p.drain_warned_ns = now;
  }
  if (p.draining.empty()) p.drain_warned_ns = 0;
}

void Transport::DrainAll(Peer& p, Done* done) {
  // `p` left peers_: no other thread adds to or polls its draining list.
  bool logged = false;
  for (Slice* s : p.draining) {
    sdk::DevStream& stream = p.staging->streams.at(s->device);
    while (stream.Wait(s->ticket, host_.NowNs() + config_.progress_timeout_ms * kMsNs).code() ==
           KVB_ERR_DEADLINE_EXCEEDED) {
      if (!logged) {
        host_.Log(KVB_LOG_WARN,
                  "verbs: %s is going, and a staging copy of a failed request has not finished "
                  "after %u ms; waiting for it before its ring is freed",
                  Who(p.node_id, p.incarnation).c_str(), config_.progress_timeout_ms);
        logged = true;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Slice* s : p.draining) EndDrain(*s, done);
  p.draining.clear();
}

void Transport::EndDrain(Slice& s, Done* done) {
  s.copy = Slice::Copy::kNone;  // it ended
  DropBounce(s);
  Request& r = *s.req;
  if (--r.draining == 0) Finalize(r, done);
}

void Transport::Finalize(Request& r, Done* done) {
  if (r.final) return;
  r.final = true;
  Peer* p = r.peer;
  if (p != nullptr) {
    p->queued_bytes -= r.charged_bytes;
    p->queued_ops -= r.charged_ops;
    p->requests.erase(&r);
  }
  stats_.queued_bytes -= r.charged_bytes;
  Request* rp = &r;
  done->push_back([rp] {
    if (rp->on_complete != nullptr) rp->on_complete(rp->user);
    rp->reported.store(true);
  });
}

// ---- host staging ----------------------------------------------------------------------------

namespace {

// The ring's copy queue on CUDA device `device`, made on first use.
sdk::Result<sdk::DevStream*> StreamOf(const sdk::Host& host, StagingRing& ring, int device) {
  auto it = ring.streams.find(device);
  if (it == ring.streams.end()) {
    auto made = host.CreateDevStream(device);
    if (!made.ok()) return made.status();
    it = ring.streams.emplace(device, std::move(*made)).first;
  }
  return &it->second;
}

}  // namespace

sdk::Result<std::unique_ptr<StagingRing>> Transport::MakeStagingRing(const std::string& who) {
  auto ring = std::make_unique<StagingRing>();
  ring->host = host_;
  ring->buffer_bytes = config_.staging_buffer_bytes;
  ring->count = config_.staging_buffers;
  const uint64_t total = ring->buffer_bytes * ring->count;
  auto mem = host_.PinnedAlloc(total);
  if (!mem.ok()) {
    return sdk::Status(mem.status().code(),
                       "verbs: cannot allocate the host staging ring for " + who +
                           " (verbs.staging_buffers x " +
                           "verbs.staging_buffer_bytes = " + std::to_string(total) +
                           " bytes of pinned memory): " + mem.status().message());
  }
  ring->base = static_cast<uint8_t*>(*mem);
  for (auto& d : devices_) {
    auto ref = d->mrs->Acquire(reinterpret_cast<uint64_t>(ring->base), total, false, -1);
    if (!ref.ok()) {
      return sdk::Status(ref.status().code(), "verbs: cannot register the host staging ring on " +
                                                  d->name + ": " + ref.status().message());
    }
    ring->caches.push_back(d->mrs.get());
    ring->mrs.push_back(std::move(*ref));
  }
  for (uint32_t i = ring->count; i > 0; --i) ring->free.push_back(static_cast<int32_t>(i - 1));
  host_.Log(KVB_LOG_DEBUG, "verbs: host staging ring for %s: %u x %" PRIu64 " bytes", who.c_str(),
            ring->count, ring->buffer_bytes);
  return ring;
}

bool Transport::StageReady(Peer& p, Slice& s, uint64_t now, Done* done) {
  StagingRing& ring = *p.staging;
  if (s.bounce < 0) {
    if (ring.free.empty()) return false;  // waits for a buffer of this peer's ring
    s.bounce = ring.free.back();
    ring.free.pop_back();
  }
  if (s.opcode == WrOpcode::kRdmaRead || s.filled) return true;
  const std::string what = "verbs: staging " + std::to_string(s.length) + " bytes of CUDA device " +
                           std::to_string(s.device) + " memory for a WRITE to " +
                           Who(p.node_id, p.incarnation) + ": ";
  if (s.copy == Slice::Copy::kNone) {
    auto stream = StreamOf(host_, ring, s.device);
    if (!stream.ok()) {
      EndSlice(s, sdk::Status(stream.status().code(), what + stream.status().message()), done);
      return false;
    }
    auto ticket = (*stream)->CopyAsync(ring.buffer(s.bounce),
                                       reinterpret_cast<const void*>(s.local_addr), s.length);
    if (!ticket.ok()) {
      ++counters_.staging_copy_failures;
      EndSlice(s, sdk::Status(ticket.status().code(), what + ticket.status().message()), done);
      return false;
    }
    s.ticket = *ticket;
    s.copy = Slice::Copy::kIn;
    stats_.device_bytes_staged += s.length;
    return false;
  }
  const sdk::Status st = ring.streams.at(s.device).Done(s.ticket);
  if (st.code() == KVB_IN_PROGRESS) return false;
  s.copy = Slice::Copy::kNone;
  if (!st.ok()) {
    ++counters_.staging_copy_failures;
    EndSlice(s, sdk::Status(st.code(), what + st.message()), done);
    return false;
  }
  ++counters_.staging_copies;
  s.filled = true;
  s.req->last_progress_ns = now;
  return true;
}

void Transport::StartCopyOut(Peer& p, Slice& s, Done* done) {
  StagingRing& ring = *p.staging;
  const std::string what = "verbs: copying " + std::to_string(s.length) + " bytes read from " +
                           Who(p.node_id, p.incarnation) + " into CUDA device " +
                           std::to_string(s.device) + " memory: ";
  auto stream = StreamOf(host_, ring, s.device);
  if (!stream.ok()) {
    EndSlice(s, sdk::Status(stream.status().code(), what + stream.status().message()), done);
    return;
  }
  auto ticket =
      (*stream)->CopyAsync(reinterpret_cast<void*>(s.local_addr), ring.buffer(s.bounce), s.length);
  if (!ticket.ok()) {
    ++counters_.staging_copy_failures;
    EndSlice(s, sdk::Status(ticket.status().code(), what + ticket.status().message()), done);
    return;
  }
  s.ticket = *ticket;
  s.copy = Slice::Copy::kOut;
  stats_.device_bytes_staged += s.length;
  p.copying_out.push_back(&s);
}

void Transport::PollCopiesOut(Peer& p, uint64_t now, Done* done) {
  std::vector<Slice*> still;
  for (Slice* s : p.copying_out) {
    const sdk::Status st = p.staging->streams.at(s->device).Done(s->ticket);
    if (st.code() == KVB_IN_PROGRESS) {
      still.push_back(s);
      continue;
    }
    s->copy = Slice::Copy::kNone;
    if (st.ok()) {
      ++counters_.staging_copies;
      s->req->last_progress_ns = now;
      EndSlice(*s, st, done);
    } else {
      ++counters_.staging_copy_failures;
      EndSlice(*s,
               sdk::Status(st.code(), "verbs: copying " + std::to_string(s->length) +
                                          " bytes read from " + Who(p.node_id, p.incarnation) +
                                          " into CUDA device " + std::to_string(s->device) +
                                          " memory: " + st.message()),
               done);
    }
  }
  p.copying_out = std::move(still);
}

void Transport::DropBounce(Slice& s) {
  if (s.bounce < 0) return;
  // No copy uses the buffer: every caller ended it (PollCopiesOut, StageReady, EndDrain) or
  // never started one; a failed request's running copies go to DrainCopies instead.
  StagingRing& ring = *s.req->peer->staging;
  ring.free.push_back(s.bounce);
  s.bounce = -1;
  s.filled = false;
}

// ---- stats -----------------------------------------------------------------------------------

sdk::Status Transport::Stats(kvb_transport_stats_t& out) {
  size_t inbound = 0;
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    inbound = inbound_.size();
  }
  std::lock_guard<std::mutex> lock(mu_);
  out = stats_;
  out.struct_size = sizeof(out);
  out.inbound_open = inbound;
  return {};
}

VerbsCounters Transport::Counters() {
  std::lock_guard<std::mutex> lock(mu_);
  VerbsCounters c = counters_;
  for (const Peer* p : peers_) {
    if (p->staging) c.staging_buffers_busy += p->staging->count - p->staging->free.size();
  }
  return c;
}

uint64_t Transport::InstanceCaps() const {
  // Without GPUDirect, host staging still takes CUDA memory (not CUDA_DIRECT: it copies).
  if (fabric_.cuda_direct) return ~uint64_t{0};
  return staging_possible_ ? ~KVB_TCAP_CUDA_DIRECT : ~(KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT);
}

}  // namespace kvbridge::verbs
