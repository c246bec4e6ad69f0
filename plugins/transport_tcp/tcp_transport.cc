// The tcp transport: lifecycle, memory registration, peers (see tcp_transport.h).
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
// Transport: lifecycle.

Transport::Transport(const kvb_host_services_t* host, const Config& config)
    : host_(host), config_(config), idle_bucket_(config.idle_close_per_sec) {}

kvb_status_t Transport::Create(const kvb_host_services_t* host,
                               const kvb_transport_params_t* params,
                               std::unique_ptr<Transport>* out, std::string* err) {
  if (host == nullptr || params == nullptr ||
      host->struct_size < offsetof(kvb_host_services_t, now_ns) + sizeof(host->now_ns) ||
      host->log == nullptr || host->config_get == nullptr || host->now_ns == nullptr) {
    *err = "create: host services or params missing";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (!KVB_HAS_FIELD(host, kvb_host_services_t, auth_end) || host->node_id == nullptr ||
      host->incarnation == nullptr || host->auth_begin == nullptr || host->auth_need == nullptr ||
      host->auth_step == nullptr || host->auth_end == nullptr) {
    *err =
        "create: the tcp plugin needs a host with the ABI 1.2 identity and handshake services "
        "(node_id, incarnation, auth_begin ... auth_end); this host is older";
    return KVB_ERR_UNAVAILABLE;
  }
  auto has = [&](size_t offset, size_t size) { return params->struct_size >= offset + size; };
  Config config;
  if (!LoadConfig(host, &config, err)) return KVB_ERR_INVALID_ARGUMENT;
  // Who this process is comes from the host (the identity the handshake proves), not from params.
  const char* node_id = host->node_id(host->host_ctx);
  if (node_id == nullptr || node_id[0] == '\0' || strlen(node_id) > wire::kMaxNodeIdBytes) {
    *err = "create: the host's node id must be 1..255 bytes";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::unique_ptr<Transport> t(new Transport(host, config));
  t->node_id_ = node_id;
  t->incarnation_ = host->incarnation(host->host_ctx);
  t->device_services_ = HasDeviceServices(host);
  std::string listen = "127.0.0.1:0";
  if (has(offsetof(kvb_transport_params_t, listen), sizeof(char*)) && params->listen != nullptr &&
      params->listen[0] != '\0') {
    listen = params->listen;
  }
  const std::vector<std::string> specs = SplitList(listen);
  if (specs.empty()) {
    *err = "create: listen list is empty";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  for (const auto& spec : specs) {
    const kvb_status_t st = t->Listen(spec, err);
    if (st != KVB_OK) return st;
  }
  for (const auto& l : t->listeners_) {
    t->endpoints_ += (t->endpoints_.empty() ? "" : ",") + l.endpoint;
  }
  t->accept_wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (t->accept_wake_fd_ < 0) {
    *err = "create: eventfd: " + ErrnoText(errno);
    return KVB_ERR_IO;
  }
  Transport* raw = t.get();
  t->accept_thread_ = std::thread([raw] { raw->AcceptLoop(); });
  t->housekeeper_ = std::thread([raw] { raw->HousekeeperLoop(); });
  t->Log(KVB_LOG_INFO, "node '%s' incarnation %#llx listening on %s", t->node_id_.c_str(),
         U(t->incarnation_), t->endpoints_.c_str());
  *out = std::move(t);
  return KVB_OK;
}

kvb_status_t Transport::Listen(const std::string& spec, std::string* err) {
  std::string host, port;
  if (!SplitHostPort(spec, &host, &port)) {
    *err = Fmt("create: listen entry '%s' is not host:port", spec.c_str());
    return KVB_ERR_INVALID_ARGUMENT;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0 || res == nullptr) {
    *err = Fmt("create: cannot resolve listen address '%s': %s", spec.c_str(), gai_strerror(gai));
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    *err = "create: socket: " + ErrnoText(errno);
    return KVB_ERR_IO;
  }
  // A restarted process can rebind the port its predecessor used at once.
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    freeaddrinfo(res);
    close(fd);
    *err = Fmt("create: cannot listen on %s: %s", spec.c_str(), ErrnoText(e).c_str());
    return KVB_ERR_IO;
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  const uint16_t bound = ss.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  const bool v6 = host.find(':') != std::string::npos;
  listeners_.push_back(
      {fd, Fmt(v6 ? "[%s]:%u" : "%s:%u", host.empty() ? "0.0.0.0" : host.c_str(), bound)});
  return KVB_OK;
}

Transport::~Transport() {
  stopping_.store(true);
  if (accept_wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(accept_wake_fd_, &one, sizeof(one));
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    std::lock_guard<std::mutex> lock(hk_mu_);
    hk_cv_.notify_all();
  }
  if (housekeeper_.joinable()) housekeeper_.join();
  std::vector<Peer*> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers.assign(peers_.begin(), peers_.end());
  }
  for (Peer* p : peers) RemovePeer(p);
  {
    std::lock_guard<std::mutex> lock(inbound_mu_);
    for (auto& c : inbound_) shutdown(c->fd, SHUT_RDWR);
  }
  ReapInbound(/*all=*/true);
  JoinGraveyard();
  prefailed_.clear();
  for (auto& l : listeners_) close(l.fd);
  if (accept_wake_fd_ >= 0) close(accept_wake_fd_);
}

void Transport::Log(int32_t level, const char* fmt, ...) const {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  host_->log(host_->host_ctx, level, "tcp", buf);
}

void Transport::RunCompletions(const Completions& done) {
  for (const auto& c : done) c.fn(c.user);
}

void Transport::Bury(std::unique_ptr<Lane> lane) {
  std::lock_guard<std::mutex> lock(graveyard_mu_);
  graveyard_.push_back(std::move(lane));
}

void Transport::JoinGraveyard() {
  std::vector<std::unique_ptr<Lane>> dead;
  {
    std::lock_guard<std::mutex> lock(graveyard_mu_);
    dead.swap(graveyard_);
  }
  for (auto& l : dead) {
    if (l->thread.joinable()) l->thread.join();
  }
}

int32_t Transport::GetEndpoints(char* buf, uint32_t buf_len) const {
  if (buf == nullptr || endpoints_.size() + 1 > buf_len) return -2;
  std::memcpy(buf, endpoints_.c_str(), endpoints_.size() + 1);
  return static_cast<int32_t>(endpoints_.size());
}

// ---------------------------------------------------------------------------------------------
// Memory registration.

kvb_status_t Transport::RegisterMemory(const kvb_region_t* region, uint8_t* rkey, uint32_t rkey_cap,
                                       uint32_t* rkey_len, std::string* err) {
  std::string ignored;
  if (err == nullptr) err = &ignored;
  if (region == nullptr ||
      region->struct_size < offsetof(kvb_region_t, length) + sizeof(region->length)) {
    *err = "register_memory: region missing or too small";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (region->mem_kind != KVB_MEM_HOST && region->mem_kind != KVB_MEM_CUDA) {
    *err = Fmt("register_memory: unknown memory kind %u", region->mem_kind);
    return KVB_ERR_UNSUPPORTED;
  }
  if (region->addr == nullptr || region->length == 0) {
    *err = "register_memory: null address or zero length";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  int device = -1;
  if (region->mem_kind == KVB_MEM_CUDA) {
    // Device memory moves through pinned bounce buffers by the host's copy services: without
    // them (a host older than ABI 1.2) there is no way to reach it.
    if (!device_services_) {
      *err =
          "register_memory: CUDA memory needs the host's ABI 1.2 device services "
          "(dev_stream_create ... pinned_free); this host does not offer them";
      return KVB_ERR_UNSUPPORTED;
    }
    device = KVB_HAS_FIELD(region, kvb_region_t, device_id) ? region->device_id : -1;
    if (device < 0) {
      *err = "register_memory: a CUDA region needs its device id (>= 0)";
      return KVB_ERR_INVALID_ARGUMENT;
    }
    // A copy queue on that device proves the driver and the device are there (UNAVAILABLE
    // naming libcuda when the host has no driver).
    char why[512] = {};
    kvb_dev_stream_t* s = nullptr;
    const kvb_status_t st = host_->dev_stream_create(host_->host_ctx, device, &s, why, sizeof(why));
    if (st != KVB_OK) {
      *err = Fmt("register_memory: CUDA region on device %d: %s", device, why);
      return st;
    }
    host_->dev_stream_destroy(host_->host_ctx, s);
  }
  auto r = std::make_shared<Region>();
  r->base = static_cast<uint8_t*>(region->addr);
  r->length = region->length;
  r->device = device;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    if (!regions_.emplace(region->segment_id, r).second) {
      *err = Fmt("register_memory: segment %llu is already registered", U(region->segment_id));
      return KVB_ERR_ALREADY_EXISTS;
    }
  }
  if (rkey_len != nullptr) *rkey_len = 0;  // tcp needs no remote key
  if (device >= 0) counters_.device_regions_staged.fetch_add(1, std::memory_order_relaxed);
  return KVB_OK;
}

kvb_status_t Transport::DeregisterMemory(uint64_t segment_id) {
  std::unique_lock<std::mutex> lock(regions_mu_);
  auto it = regions_.find(segment_id);
  if (it == regions_.end()) return KVB_ERR_NOT_FOUND;
  std::shared_ptr<Region> r = it->second;
  regions_.erase(it);
  // Connections still inside the region (a WRITE being received, a READ being sent) are shut
  // down rather than waited for: a stalled or trickling peer cannot hold this call. Their
  // threads leave at once (recv/send fail); the descriptors stay valid until then, as a
  // connection is closed only after its thread ended.
  if (r->in_use > 0) {
    Log(KVB_LOG_WARN,
        "deregistering segment %llu: cutting %zu inbound connection(s) still using it",
        U(segment_id), r->users.size());
    for (int fd : r->users) shutdown(fd, SHUT_RDWR);
  }
  regions_cv_.wait(lock, [&] { return r->in_use == 0; });
  return KVB_OK;
}

// ---------------------------------------------------------------------------------------------
// Peers.

namespace {

// Reads endpoints and segments from a peer info; false with *err on malformed input.
bool ParsePeerInfo(const kvb_peer_info_t* info, std::vector<std::string>* endpoints,
                   std::unordered_map<uint64_t, uint64_t>* segments, std::string* err) {
  if (info == nullptr ||
      info->struct_size < offsetof(kvb_peer_info_t, num_segments) + sizeof(uint32_t)) {
    *err = "peer info missing or too small";
    return false;
  }
  if (info->node_id == nullptr || info->node_id[0] == '\0' ||
      strlen(info->node_id) > wire::kMaxNodeIdBytes) {
    *err = "peer node_id must be 1..255 bytes";
    return false;
  }
  *endpoints = SplitList(info->endpoints != nullptr ? info->endpoints : "");
  if (endpoints->empty()) {
    *err = Fmt("peer '%s' publishes no tcp endpoint", info->node_id);
    return false;
  }
  for (const auto& ep : *endpoints) {
    std::string host, port;
    if (!SplitHostPort(ep, &host, &port) || host.empty()) {
      *err = Fmt("peer '%s': endpoint '%s' is not host:port", info->node_id, ep.c_str());
      return false;
    }
  }
  if (info->num_segments > 0) {
    if (info->segments == nullptr) {
      *err = "peer segments missing";
      return false;
    }
    // Elements are segment_size bytes apart (the host's sizeof(kvb_peer_segment_t)).
    const uint32_t stride = info->segment_size;
    if (stride < offsetof(kvb_peer_segment_t, length) + sizeof(uint64_t)) {
      *err = "peer segment struct_size too small";
      return false;
    }
    const auto* base = reinterpret_cast<const uint8_t*>(info->segments);
    for (uint32_t i = 0; i < info->num_segments; ++i) {
      const auto* s = reinterpret_cast<const kvb_peer_segment_t*>(base + size_t(i) * stride);
      (*segments)[s->segment_id] = s->length;
    }
  }
  return true;
}

}  // namespace

kvb_status_t Transport::AddPeer(const kvb_peer_info_t* info, Peer** out, std::string* err) {
  if (out == nullptr) {
    *err = "add_peer: out is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  auto peer = std::make_unique<Peer>();
  if (!ParsePeerInfo(info, &peer->endpoints, &peer->segment_lengths, err)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  peer->node_id = info->node_id;
  peer->incarnation = info->incarnation;
  std::lock_guard<std::mutex> lock(peers_mu_);
  *out = peer.get();
  peers_.insert(peer.release());
  return KVB_OK;
}

kvb_status_t Transport::UpdatePeer(Peer* peer, const kvb_peer_info_t* info, std::string* err) {
  std::vector<std::string> endpoints;
  std::unordered_map<uint64_t, uint64_t> segments;
  if (peer == nullptr) {
    *err = "update_peer: peer is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (!ParsePeerInfo(info, &endpoints, &segments, err)) return KVB_ERR_INVALID_ARGUMENT;
  if (peer->node_id != info->node_id || peer->incarnation != info->incarnation) {
    *err = "update_peer: another incarnation is another peer (use add_peer)";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(peer->mu);
  const std::string preferred = peer->endpoints[peer->preferred];
  peer->endpoints = std::move(endpoints);
  auto it = std::find(peer->endpoints.begin(), peer->endpoints.end(), preferred);
  peer->preferred = it == peer->endpoints.end() ? 0 : it - peer->endpoints.begin();
  peer->segment_lengths = std::move(segments);
  return KVB_OK;
}

void Transport::RemovePeer(Peer* peer) {
  if (peer == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers_.erase(peer);
  }
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    peer->removing = true;
    live.swap(peer->live);
    for (auto& l : peer->lanes) l->Stop();
  }
  for (auto& r : live) CancelRequest(r);
  {
    std::unique_lock<std::mutex> lock(peer->mu);
    peer->cv.wait(lock, [&] { return peer->lanes.empty(); });
    peer->queue.clear();
  }
  JoinGraveyard();
  delete peer;
}

}  // namespace kvbridge::tcp
