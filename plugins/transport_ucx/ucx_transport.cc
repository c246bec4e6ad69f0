#include "ucx_transport.h"

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <string>

#include "host_config.h"
#include "ucx_worker.h"
#include "util/host_key.h"

namespace kvbridge::ucx {
namespace {

constexpr char kName[] = "ucx";
constexpr uint64_t kMsNs = 1'000'000ull;

std::string U(uint64_t v) { return std::to_string(v); }

// The host services a transport needs for the hello (ABI 1.2); the first one missing, or "".
std::string MissingAuthServices(const kvb_host_services_t* h) {
  if (h == nullptr || !KVB_HAS_FIELD(h, kvb_host_services_t, auth_end)) {
    return "the host's services table predates ABI 1.2 (no node_id/incarnation/auth_* services)";
  }
  const char* missing = h->node_id == nullptr       ? "node_id"
                        : h->incarnation == nullptr ? "incarnation"
                        : h->auth_begin == nullptr  ? "auth_begin"
                        : h->auth_need == nullptr   ? "auth_need"
                        : h->auth_step == nullptr   ? "auth_step"
                        : h->auth_peer == nullptr   ? "auth_peer"
                        : h->auth_end == nullptr    ? "auth_end"
                                                    : nullptr;
  return missing == nullptr ? std::string()
                            : std::string("the host service '") + missing +
                                  "' is NULL (the host implements no identity handshake)";
}

int PidfdOpen(int pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err) {
  Config c;
  auto read = [&](const char* key, uint64_t min, uint64_t max, auto* field) -> bool {
    std::string v;
    bool set = false;
    if (!plugin::ReadConfigKey(host, kName, key, &v, &set, err)) return false;
    if (!set) return true;
    uint64_t value = 0;
    if (!plugin::ParseUnsigned(v, &value) || value < min || value > max) {
      *err =
          std::string(key) + ": '" + v + "' is not an integer in [" + U(min) + ", " + U(max) + "]";
      return false;
    }
    *field = static_cast<std::remove_reference_t<decltype(*field)>>(value);
    return true;
  };
  const bool ok =
      read("ucx.slice_bytes", 1, 1ull << 30, &c.slice_bytes) &&
      read("ucx.max_inflight_bytes_per_ep", 1, 1ull << 40, &c.max_inflight_bytes_per_ep) &&
      read("ucx.max_queued_bytes_per_peer", 1, 1ull << 62, &c.max_queued_bytes_per_peer) &&
      read("ucx.max_queued_slices_per_peer", 1, 1ull << 40, &c.max_queued_slices_per_peer) &&
      read("ucx.connect_timeout_ms", 1, 600000, &c.connect_timeout_ms) &&
      read("ucx.progress_timeout_ms", 1, 3600000, &c.progress_timeout_ms) &&
      read("ucx.cancel_drain_ms", 0, 60000, &c.cancel_drain_ms) &&
      read("ucx.spin_us", 0, 1000000, &c.spin_us) &&
      read("ucx.idle_poll_ms", 1, 1000, &c.idle_poll_ms) &&
      read("ucx.max_handshakes", 1, 1000000, &c.max_handshakes);
  if (!ok) return false;
  std::string v;
  bool set = false;
  if (!plugin::ReadConfigKey(host, kName, "ucx.same_host", &v, &set, err)) return false;
  if (set && v != "auto" && v != "off") {
    *err = "ucx.same_host: '" + v + "' is neither auto nor off";
    return false;
  }
  c.same_host_auto = !set || v == "auto";
  if (!plugin::ReadConfigKey(host, kName, "ucx.tls", &c.tls, &set, err)) return false;
  *out = c;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Endpoints text.

namespace {
constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string Base64Encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= uint32_t(uint8_t(in[i + 1])) << 8;
    if (i + 2 < in.size()) v |= uint8_t(in[i + 2]);
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=');
    out.push_back(i + 2 < in.size() ? kB64[v & 63] : '=');
  }
  return out;
}

bool Base64Decode(const std::string& in, std::string* out) {
  if (in.size() % 4 != 0) return false;
  out->clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = in[i + j];
      const char* p = c == '=' ? nullptr : std::strchr(kB64, c);
      if (c == '=') {
        if (i + 4 != in.size() || j < 2) return false;
        ++pad;
      } else if (p == nullptr || c == '\0' || pad > 0) {
        return false;
      }
      v = (v << 6) | (p ? uint32_t(p - kB64) : 0);
    }
    out->push_back(char((v >> 16) & 0xff));
    if (pad < 2) out->push_back(char((v >> 8) & 0xff));
    if (pad < 1) out->push_back(char(v & 0xff));
  }
  return true;
}

std::string FormatEndpoints(const std::string& address, const std::string& host_key, int pid) {
  return "ucx1;a=" + Base64Encode(address) + ";h=" + host_key + ";p=" + std::to_string(pid);
}

bool ParseEndpoints(const std::string& text, PeerAddress* out, std::string* err) {
  if (text.rfind("ucx1;", 0) != 0) {
    *err = "endpoints '" + text.substr(0, 32) + "' are not ucx1;...";
    return false;
  }
  PeerAddress a;
  size_t pos = 5;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find(';', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.size() < 2 || item[1] != '=') continue;  // unknown items are for newer versions
    const std::string v = item.substr(2);
    uint64_t pid = 0;
    if (item[0] == 'a' && !Base64Decode(v, &a.worker_address)) {
      *err = "the worker address is not base64";
      return false;
    } else if (item[0] == 'h') {
      a.host_key = v;
    } else if (item[0] == 'p') {
      if (!plugin::ParseUnsigned(v, &pid) || pid == 0 || pid > 0x7fffffff) {
        *err = "pid '" + v + "' is not a process id";
        return false;
      }
      a.pid = static_cast<int>(pid);
    }
  }
  if (a.worker_address.empty() || a.pid == 0) {
    *err = "endpoints lack the worker address (a=) or the pid (p=)";
    return false;
  }
  *out = std::move(a);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Instance.

Transport::Transport(const kvb_host_services_t* host, const Config& config)
    : host_(host), config_(config), host_key_(util::HostKey()) {}

kvb_status_t Transport::Create(const kvb_host_services_t* host,
                               const kvb_transport_params_t* params,
                               std::unique_ptr<Transport>* out, std::string* err) {
  if (host == nullptr || params == nullptr || host->now_ns == nullptr) {
    *err = "ucx: create needs the host services and params";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (const std::string missing = MissingAuthServices(host); !missing.empty()) {
    // Identity before any RMA: without the host's handshake the plugin cannot prove who it
    // reaches, so it refuses to run at all.
    *err = "ucx: cannot run: " + missing +
           "; the ucx transport needs the ABI 1.2 host services "
           "node_id, incarnation, auth_begin, auth_need, auth_step, auth_peer and auth_end";
    return KVB_ERR_UNAVAILABLE;
  }
  Config config;
  if (!LoadConfig(host, &config, err)) {
    *err = "ucx: " + *err;
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::unique_ptr<Transport> t(new Transport(host, config));
  const kvb_status_t st = Worker::Create(t.get(), &t->worker_, err);
  if (st != KVB_OK) return st;
  *out = std::move(t);
  return KVB_OK;
}

Transport::~Transport() {
  std::vector<Peer*> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers.assign(peers_.begin(), peers_.end());
  }
  for (Peer* p : peers) RemovePeer(p);
  // Gently closed endpoints (RemovePeer) may still await the peers' completions: give them
  // ucx.cancel_drain_ms before the worker force-closes what is left.
  const uint64_t until = Now() + uint64_t(config_.cancel_drain_ms) * 1'000'000ull;
  for (bool idle = false; !idle && Now() < until;) {
    worker_->RunSync([&] { idle = worker_->ClosingIdle(); });
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<uint64_t> segments;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    for (const auto& [id, region] : regions_) segments.push_back(id);
  }
  for (uint64_t id : segments) DeregisterMemory(id);  // ucp_cleanup requires every map undone
  worker_.reset();
}

void Transport::Log(int32_t level, const std::string& msg) const {
  plugin::HostLog(host_, level, kName, msg);
}

void Transport::RunCompletions(const Completions& done) {
  for (const auto& c : done) c.fn(c.user);
}

bool Transport::cuda_memory() const {
  return (worker_->memory_types() & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

bool Transport::same_host_shm() const {
  if (!config_.same_host_auto) return false;
  std::string tls = config_.tls;
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "";
  }
  if (tls.empty()) return true;  // UCX's own choice includes them
  // "^a,b" means every transport but a and b: only excluding the whole shared-memory family
  // ("sm" or "shm") rules it out. Otherwise one of its members must be named.
  const bool except = tls[0] == '^';
  std::stringstream list(except ? tls.substr(1) : tls);
  bool family = false, member = false;
  for (std::string t; std::getline(list, t, ',');) {
    family = family || t == "sm" || t == "shm" || t == "all";
    member = member || t == "posix" || t == "sysv" || t == "cma" || t == "knem" || t == "xpmem";
  }
  return except ? !family : family || member;
}

std::string Transport::memory_types() const {
  std::string out;
  for (int m = 0; m < UCS_MEMORY_TYPE_LAST; ++m) {
    if ((worker_->memory_types() & UCS_BIT(m)) == 0) continue;
    out += (out.empty() ? "" : ", ") + std::string(ucs_memory_type_names[m]);
  }
  return out;
}

std::string Transport::EndpointsText() const {
  return FormatEndpoints(worker_->address(), host_key_, getpid());
}

// ---------------------------------------------------------------------------------------------
// Memory.

kvb_status_t Transport::RegisterMemory(const kvb_region_t* region, uint32_t rkey_cap,
                                       std::string* rkey, std::string* err) {
  if (region == nullptr || region->addr == nullptr || region->length == 0) {
    *err = "ucx: register_memory: null address or zero length";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const bool cuda = region->mem_kind == KVB_MEM_CUDA;
  if (region->mem_kind != KVB_MEM_HOST && !cuda) {
    *err = "ucx: register_memory: mem_kind " + U(region->mem_kind) + " is neither host nor CUDA";
    return KVB_ERR_UNSUPPORTED;
  }
  if (cuda && !cuda_memory()) {
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    *err = "ucx: UCX " + U(major) + "." + U(minor) + "." + U(release) + " here moves only [" +
           memory_types() +
           "] memory, not CUDA (a UCX built without CUDA, or no GPU or driver on this machine)";
    return KVB_ERR_UNSUPPORTED;
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    if (regions_.count(region->segment_id) != 0) {
      *err = "ucx: segment " + U(region->segment_id) + " is already registered";
      return KVB_ERR_ALREADY_EXISTS;
    }
  }
  kvb_status_t st = KVB_OK;
  ucp_mem_h memh = nullptr;
  worker_->RunSync([&] {
    st = worker_->MapMemory(region->addr, region->length, cuda, &memh, rkey, err);
    if (st == KVB_OK && rkey->size() <= rkey_cap) worker_->Published(region->segment_id);
  });
  if (st != KVB_OK) return st;
  if (rkey->size() > rkey_cap) {
    *err = "ucx: the rkey needs " + U(rkey->size()) + " bytes, the host offers " + U(rkey_cap);
    std::promise<void> unmapped;
    worker_->Run([&] { worker_->UnmapWhenIdle(memh, nullptr, 0, [&] { unmapped.set_value(); }); });
    unmapped.get_future().wait();
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(regions_mu_);
  regions_[region->segment_id] =
      Region{static_cast<uint8_t*>(region->addr), region->length, memh, cuda};
  if (cuda) counters_.device_regions_direct.fetch_add(1, std::memory_order_relaxed);
  return KVB_OK;
}

kvb_status_t Transport::DeregisterMemory(uint64_t segment_id) {
  Region r;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto it = regions_.find(segment_id);
    if (it == regions_.end()) return KVB_ERR_NOT_FOUND;
    r = it->second;
    regions_.erase(it);  // new posts naming it fail NOT_REGISTERED from here on
  }
  std::promise<void> unmapped;
  // Peers holding a grant for the segment acknowledge its revocation first: one-sided RMA
  // (cma, tcp's software RMA) is not checked by the target, so this is what refuses them.
  worker_->Run([&] {
    worker_->Revoke(segment_id, r.memh, r.base, r.length, [&] { unmapped.set_value(); });
  });
  unmapped.get_future().wait();
  return KVB_OK;
}

// ---------------------------------------------------------------------------------------------
// Peers.

namespace {

bool ParsePeerInfo(const kvb_peer_info_t* info, PeerAddress* address,
                   std::unordered_map<uint64_t, RemoteSegment>* segments, std::string* err) {
  if (info == nullptr ||
      info->struct_size < offsetof(kvb_peer_info_t, segment_size) + sizeof(uint32_t)) {
    *err = "ucx: peer info missing or too small";
    return false;
  }
  if (info->node_id == nullptr || info->node_id[0] == '\0') {
    *err = "ucx: peer node_id is empty";
    return false;
  }
  if (!ParseEndpoints(info->endpoints != nullptr ? info->endpoints : "", address, err)) {
    *err = std::string("ucx: peer '") + info->node_id + "': " + *err;
    return false;
  }
  if (info->num_segments > 0 && info->segments == nullptr) {
    *err = "ucx: peer segments missing";
    return false;
  }
  const uint32_t stride = info->segment_size;
  if (info->num_segments > 0 &&
      stride < offsetof(kvb_peer_segment_t, rkey_len) + sizeof(uint32_t)) {
    *err = "ucx: peer segment struct_size too small to carry rkeys";
    return false;
  }
  const auto* base = reinterpret_cast<const uint8_t*>(info->segments);
  for (uint32_t i = 0; i < info->num_segments; ++i) {
    const auto* s = reinterpret_cast<const kvb_peer_segment_t*>(base + size_t(i) * stride);
    if (s->mem_kind != KVB_MEM_HOST) continue;  // not reachable over this transport
    if (s->rkey == nullptr || s->rkey_len <= 8) {
      *err = std::string("ucx: peer '") + info->node_id + "' segment " + U(s->segment_id) +
             " has no ucx rkey (" + U(s->rkey_len) + " bytes)";
      return false;
    }
    (*segments)[s->segment_id] =
        RemoteSegment{s->length, std::string(reinterpret_cast<const char*>(s->rkey), s->rkey_len)};
  }
  return true;
}

}  // namespace

void Transport::WatchLiveness(const std::string& node_id, const PeerAddress& address,
                              bool* same_host, int* pidfd, bool* exited) const {
  *same_host = config_.same_host_auto && !host_key_.empty() && address.host_key == host_key_;
  *pidfd = -1;
  *exited = false;
  if (!*same_host) return;
  // NONE-mode endpoints have no UCX error handling: the peer's liveness is watched here.
  *pidfd = PidfdOpen(address.pid);
  if (*pidfd >= 0) return;
  if (errno == ESRCH) {
    *exited = true;
  } else {
    Log(KVB_LOG_WARN, "ucx: pidfd_open(" + U(address.pid) + "): " + strerror(errno) + "; peer '" +
                          node_id + "' is reached in PEER mode");
    *same_host = false;
  }
}

kvb_status_t Transport::AddPeer(const kvb_peer_info_t* info, Peer** out, std::string* err) {
  if (out == nullptr) {
    *err = "ucx: add_peer: out is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  auto peer = std::make_unique<Peer>();
  if (!ParsePeerInfo(info, &peer->address, &peer->segments, err)) return KVB_ERR_INVALID_ARGUMENT;
  peer->node_id = info->node_id;
  peer->incarnation = info->incarnation;
  WatchLiveness(peer->node_id, peer->address, &peer->same_host, &peer->pidfd, &peer->exited);
  Peer* raw = peer.get();
  worker_->RunSync([&] { worker_->AddPeer(raw); });
  std::lock_guard<std::mutex> lock(peers_mu_);
  peers_.insert(peer.release());
  *out = raw;
  return KVB_OK;
}

kvb_status_t Transport::UpdatePeer(Peer* peer, const kvb_peer_info_t* info, std::string* err) {
  if (peer == nullptr) {
    *err = "ucx: update_peer: peer is null";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  PeerAddress address;
  std::unordered_map<uint64_t, RemoteSegment> segments;
  if (!ParsePeerInfo(info, &address, &segments, err)) return KVB_ERR_INVALID_ARGUMENT;
  if (peer->node_id != info->node_id || peer->incarnation != info->incarnation) {
    *err = "ucx: update_peer: another incarnation is another peer (use add_peer)";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    peer->segments = std::move(segments);
    ++peer->segments_version;  // endpoints re-unpack rkeys before their next RMA
  }
  if (address.worker_address != peer->address.worker_address || address.pid != peer->address.pid ||
      address.host_key != peer->address.host_key) {
    bool same_host = false, exited = false;
    int pidfd = -1, old = -1;
    WatchLiveness(peer->node_id, address, &same_host, &pidfd, &exited);
    worker_->RunSync([&] { old = worker_->Readdress(peer, address, same_host, pidfd, exited); });
    if (old >= 0) close(old);
  }
  return KVB_OK;
}

void Transport::RemovePeer(Peer* peer) {
  if (peer == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (peers_.erase(peer) == 0) return;
  }
  std::vector<std::shared_ptr<Request>> reqs;
  worker_->RunSync([&] { reqs = worker_->RemovePeer(peer); });
  for (auto& r : reqs) {
    std::unique_lock<std::mutex> lock(r->mu);
    r->cv.wait(lock, [&] { return r->in_ucx == 0; });
  }
  if (peer->pidfd >= 0) close(peer->pidfd);
  delete peer;
}

// ---------------------------------------------------------------------------------------------
// Requests.

void Transport::Finalize(Request& r, Completions* done) {
  r.final = true;
  if (r.peer != nullptr) {
    r.peer->queued_bytes.fetch_sub(r.charged_bytes);
    r.peer->queued_slices.fetch_sub(r.charged_slices);
  }
  counters_.queued_bytes.fetch_sub(r.charged_bytes);
  r.peer = nullptr;
  if (r.on_complete != nullptr) done->push_back({r.on_complete, r.user});
  r.cv.notify_all();
}

void Transport::EndSlice(Slice& s, kvb_status_t code, const std::string& msg, Completions* done) {
  if (s.ended) return;
  s.ended = true;
  Request& r = *s.req;
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.final) return;
  OpState& op = r.ops[s.op];
  if (code != KVB_OK && op.error == KVB_OK) {
    op.error = code;
    op.msg = msg;
  }
  if (++op.ended_slices == op.total_slices) {
    op.status = op.error;
    if (op.error == KVB_OK) {
      (op.opcode == KVB_OP_READ ? counters_.bytes_read : counters_.bytes_written)
          .fetch_add(op.length);
    }
  }
  if (--r.outstanding_slices == 0) Finalize(r, done);
}

void Transport::FailRequest(Request& r, kvb_status_t code, const std::string& msg,
                            Completions* done) {
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.final) return;
  for (auto& op : r.ops) {
    if (op.status != KVB_IN_PROGRESS) continue;
    op.status = op.error != KVB_OK ? op.error : code;
    if (op.error == KVB_OK) op.msg = msg;
  }
  Finalize(r, done);
}

kvb_status_t Transport::Post(Peer* peer, const kvb_xfer_op_t* ops, uint32_t op_size, uint32_t count,
                             const kvb_post_opts_t* opts, RequestHandle** out, std::string* err) {
  if (peer == nullptr || out == nullptr || ops == nullptr || count == 0) {
    *err = "ucx: post: peer, ops and out are required and count must be > 0";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (op_size < KVB_XFER_OP_SIZE_1_0) {
    *err = "ucx: post: op_size " + U(op_size) + " is smaller than a 1.0 kvb_xfer_op_t";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  auto req = std::make_shared<Request>();
  req->progress_timeout_ns = uint64_t(config_.progress_timeout_ms) * kMsNs;
  if (opts != nullptr) {
    auto has = [&](size_t offset, size_t size) { return opts->struct_size >= offset + size; };
    if (has(offsetof(kvb_post_opts_t, deadline_ns), 8)) req->deadline_ns = opts->deadline_ns;
    if (has(offsetof(kvb_post_opts_t, progress_timeout_ns), 8) && opts->progress_timeout_ns) {
      req->progress_timeout_ns = opts->progress_timeout_ns;
    }
    if (has(offsetof(kvb_post_opts_t, user), sizeof(void*))) {
      req->on_complete = opts->on_complete;
      req->user = opts->user;
    }
  }
  std::vector<bool> local_cuda(count, false);
  auto op_at = [&](uint32_t i) -> const kvb_xfer_op_t& {
    return *reinterpret_cast<const kvb_xfer_op_t*>(reinterpret_cast<const uint8_t*>(ops) +
                                                   size_t(i) * op_size);
  };
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    for (uint32_t i = 0; i < count; ++i) {
      const kvb_xfer_op_t& op = op_at(i);
      if (op.opcode != KVB_OP_READ && op.opcode != KVB_OP_WRITE) {
        *err = "ucx: post: op " + U(i) + ": opcode " + U(op.opcode) + " is neither READ nor WRITE";
        return KVB_ERR_INVALID_ARGUMENT;
      }
      if (op.local_addr == nullptr || op.length == 0) {
        *err = "ucx: post: op " + U(i) + ": null local address or zero length";
        return KVB_ERR_INVALID_ARGUMENT;
      }
      auto it = regions_.find(op.local_segment);
      const auto addr = reinterpret_cast<uintptr_t>(op.local_addr);
      const auto base = it == regions_.end() ? 0 : reinterpret_cast<uintptr_t>(it->second.base);
      if (it == regions_.end() || addr < base || addr - base > it->second.length ||
          op.length > it->second.length - (addr - base)) {
        *err = "ucx: post: op " + U(i) + ": local memory is not inside registered segment " +
               U(op.local_segment);
        return KVB_ERR_NOT_REGISTERED;
      }
      if (it->second.cuda) local_cuda[i] = true;
    }
  }
  req->ops.resize(count);
  req->target = peer;
  std::vector<SlicePtr> slices;
  std::vector<Worker::Prefailed> prefailed;
  auto make_slice = [&](uint32_t i) {
    auto s = std::make_shared<Slice>();
    s->req = req;
    s->op = i;
    s->opcode = static_cast<uint16_t>(op_at(i).opcode);
    s->segment = op_at(i).remote_segment;
    s->local_cuda = local_cuda[i];
    return s;
  };
  uint64_t bytes = 0, nslices = 0;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    // Checked against the peer's published segments before anything is queued or issued.
    for (uint32_t i = 0; i < count; ++i) {
      const kvb_xfer_op_t& op = op_at(i);
      OpState& st = req->ops[i];
      st.opcode = static_cast<uint16_t>(op.opcode);
      st.length = op.length;
      auto seg = peer->segments.find(op.remote_segment);
      if (seg == peer->segments.end() || op.remote_offset > seg->second.length ||
          op.length > seg->second.length - op.remote_offset) {
        const bool known = seg != peer->segments.end();
        st.total_slices = 1;
        ++nslices;
        prefailed.push_back({make_slice(i), known ? KVB_ERR_OUT_OF_BOUNDS : KVB_ERR_NOT_REGISTERED,
                             known ? "ucx: op " + U(i) + ": [" + U(op.remote_offset) + ", +" +
                                         U(op.length) + ") is outside segment " +
                                         U(op.remote_segment) + " of peer '" + peer->node_id +
                                         "' (" + U(seg->second.length) + " bytes)"
                                   : "ucx: op " + U(i) + ": segment " + U(op.remote_segment) +
                                         " is not registered at peer '" + peer->node_id + "'"});
        continue;
      }
      bytes += op.length;
      for (uint64_t off = 0; off < op.length; off += config_.slice_bytes) {
        auto s = make_slice(i);
        s->local = static_cast<uint8_t*>(op.local_addr) + off;
        s->offset = op.remote_offset + off;
        s->length = std::min(config_.slice_bytes, op.length - off);
        slices.push_back(std::move(s));
        ++st.total_slices;
        ++nslices;
      }
    }
    const uint64_t qs = peer->queued_slices.load(), qb = peer->queued_bytes.load();
    if (qs > 0 && nslices > config_.max_queued_slices_per_peer -
                                std::min(qs, config_.max_queued_slices_per_peer)) {
      *err = "ucx: post: peer '" + peer->node_id + "' has " + U(qs) + " slices queued; " +
             U(nslices) + " more exceed ucx.max_queued_slices_per_peer (" +
             U(config_.max_queued_slices_per_peer) + ")";
      return KVB_ERR_BACKPRESSURE;
    }
    if (qb > 0 && bytes > config_.max_queued_bytes_per_peer -
                              std::min(qb, config_.max_queued_bytes_per_peer)) {
      *err = "ucx: post: peer '" + peer->node_id + "' has " + U(qb) + " bytes queued; " + U(bytes) +
             " more exceed ucx.max_queued_bytes_per_peer (" + U(config_.max_queued_bytes_per_peer) +
             ")";
      return KVB_ERR_BACKPRESSURE;
    }
    req->outstanding_slices = static_cast<uint32_t>(nslices);
    req->charged_bytes = bytes;
    req->charged_slices = nslices;
    req->peer = peer;
    peer->queued_bytes.fetch_add(bytes);
    peer->queued_slices.fetch_add(nslices);
  }
  counters_.queued_bytes.fetch_add(bytes);
  auto handle = std::make_unique<RequestHandle>();
  handle->req = req;
  worker_->Run([w = worker_.get(), peer, slices = std::move(slices),
                prefailed = std::move(prefailed)]() mutable {
    w->Enqueue(peer, std::move(slices), std::move(prefailed));
  });
  *out = handles_.Adopt(std::move(handle));
  return KVB_OK;
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
  if (h == nullptr) return;
  const std::shared_ptr<Request>& req = h->req;
  bool was_final, in_ucx;
  Completions done;
  {
    std::lock_guard<std::mutex> lock(req->mu);
    was_final = req->final;
  }
  FailRequest(*req, KVB_ERR_CANCELLED, "cancelled", &done);
  RunCompletions(done);
  {
    std::lock_guard<std::mutex> lock(req->mu);
    in_ucx = req->in_ucx > 0;
  }
  // The thread drops queued slices and, if UCX still holds this request's memory on a
  // PEER-mode endpoint, force-closes it. Once in_ucx is 0 UCX no longer touches the memory.
  if (!was_final || in_ucx) worker_->Run([w = worker_.get(), req] { w->Abort(req); });
  if (!in_ucx) return;
  std::unique_lock<std::mutex> lock(req->mu);
  req->cv.wait(lock, [&] { return req->in_ucx == 0; });
}

void Transport::Release(RequestHandle* h) {
  if (h == nullptr) return;
  bool final;
  {
    std::lock_guard<std::mutex> lock(h->req->mu);
    final = h->req->final;
  }
  // A final request is freed without waiting: on a NONE-mode endpoint UCX may still hold its
  // RMA (a stalled same-host peer; FORCE close is not allowed there). The request's state lives
  // on with those operations, and deregister_memory waits for them before unmapping, so the
  // memory stays valid until the host deregisters it. A request released unfinished (a host
  // bug) is cancelled first.
  if (!final) Cancel(h);
  handles_.Free(h);
}

kvb_status_t Transport::GetStats(kvb_transport_stats_t* stats) const {
  if (stats == nullptr || stats->struct_size < sizeof(uint32_t)) return KVB_ERR_INVALID_ARGUMENT;
  kvb_transport_stats_t s{};
  s.connections_open = counters_.connections_open.load();
  s.connections_opened = counters_.connections_opened.load();
  s.connections_evicted = counters_.connections_evicted.load();
  s.inbound_open = counters_.inbound_open.load();
  s.bytes_written = counters_.bytes_written.load();
  s.bytes_read = counters_.bytes_read.load();
  s.frames_rejected = counters_.frames_rejected.load();
  s.queued_bytes = counters_.queued_bytes.load();
  s.device_regions_direct = counters_.device_regions_direct.load();
  const uint32_t size = stats->struct_size;
  std::memcpy(stats, &s, std::min<size_t>(size, sizeof(s)));
  stats->struct_size = size;
  return KVB_OK;
}

}  // namespace kvbridge::ucx
