#include "core/transport_instance.h"

#include <utility>

#include "core/descriptor.h"
#include "core/host_services.h"
#include "core/plugin_loader.h"
#include "util/logging.h"

namespace kvbridge::core {
namespace {

constexpr uint32_t kErrLen = 512;
constexpr uint32_t kEndpointsLen = 4096;

// The plugin's status with the message it wrote into its error buffer (may be empty; one it
// did not NUL-terminate is cut at the buffer's end).
Status FromPlugin(kvb_status_t st, char (&err)[kErrLen]) {
  err[kErrLen - 1] = '\0';
  return Status::FromAbi(st, err);
}

// kvb_peer_info_t over a PeerView: the strings it points to are copied so they are
// NUL-terminated, and live as long as this object.
struct PeerInfoAbi {
  std::string node_id;
  std::string endpoints;
  std::vector<kvb_peer_segment_t> segments;
  kvb_peer_info_t info{};

  explicit PeerInfoAbi(const TransportInstance::PeerView& v)
      : node_id(v.node_id), endpoints(v.endpoints) {
    segments.reserve(v.segments.size());
    for (const auto& s : v.segments) {
      segments.push_back(kvb_peer_segment_t{
          .struct_size = sizeof(kvb_peer_segment_t),
          .mem_kind = s.mem_kind,
          .segment_id = s.id,
          .length = s.length,
          .rkey = s.rkey.empty() ? nullptr : reinterpret_cast<const uint8_t*>(s.rkey.data()),
          .rkey_len = static_cast<uint32_t>(s.rkey.size())});
    }
    info = kvb_peer_info_t{.struct_size = sizeof(kvb_peer_info_t),
                           .node_id = node_id.c_str(),
                           .incarnation = v.incarnation,
                           .endpoints = endpoints.c_str(),
                           .segments = segments.data(),
                           .num_segments = static_cast<uint32_t>(segments.size()),
                           .segment_size = sizeof(kvb_peer_segment_t)};
  }
};

}  // namespace

Result<std::unique_ptr<TransportInstance>> TransportInstance::Create(
    std::shared_ptr<const void> library_owner, const PluginInfo& plugin,
    const TransportConfig& config) {
  const kvb_transport_ops_t* ops = plugin.transport_ops();
  if (ops == nullptr) {
    return Status::InvalidArgument("'" + plugin.name + "' (" + plugin.path +
                                   ") is not a loaded transport plugin");
  }
  std::unique_ptr<TransportInstance> t(new TransportInstance());
  t->library_owner_ = std::move(library_owner);
  t->ops_ = ops;
  t->name_ = plugin.name;
  t->caps_ = plugin.caps;
  const kvb_host_services_t* services = config.services;
  if (services == nullptr) {
    // The host holds identity and token (ABI 1.2 services): the transport authenticates peers
    // through it and never sees the token.
    t->services_ = std::make_unique<HostServices>(
        config.plugin_config,
        auth::Identity{config.node_id, config.incarnation, config.cluster_token});
    services = t->services_->table();
  }
  kvb_transport_params_t params{
      .struct_size = sizeof(kvb_transport_params_t),
      .node_id = config.node_id.c_str(),
      .incarnation = config.incarnation,
      .listen = config.listen.c_str(),
      // Deprecated: only plugins built for ABI 1.0/1.1 (no auth services) still get it.
      .cluster_token = plugin.descriptor != nullptr && plugin.descriptor->abi_minor < 2
                           ? config.cluster_token.c_str()
                           : nullptr,
  };
  char err[kErrLen] = {0};
  kvb_status_t st = ops->create(services, &params, &t->inst_, err, kErrLen);
  if (st != KVB_OK) {
    t->inst_ = nullptr;
    return FromPlugin(st, err).WithContext("transport '" + plugin.name + "' (" + plugin.path +
                                           ") failed to start");
  }
  if (TransportHasInstanceCaps(*ops)) {
    // An instance can only drop caps its descriptor declared (say CUDA_MEM on a machine where
    // the plugin's library cannot move device memory), never add one.
    const uint64_t kept = t->caps_ & ops->instance_caps(t->inst_);
    if (kept != t->caps_) {
      KVB_LOG(INFO) << "transport '" << plugin.name << "': this instance has caps 0x" << std::hex
                    << kept << " of its descriptor's 0x" << t->caps_ << std::dec;
    }
    t->caps_ = kept;
  }
  char ep[kEndpointsLen];
  int32_t n = ops->get_endpoints(t->inst_, ep, sizeof(ep));
  t->endpoints_ = n >= 0 ? std::string(ep, static_cast<size_t>(n)) : std::string();
  return t;
}

TransportInstance::~TransportInstance() {
  alive_.reset();  // handles still held elsewhere become inert
  if (inst_ != nullptr) ops_->destroy(inst_);
}

Result<TransportInstance::Registration> TransportInstance::RegisterMemory(
    uint64_t segment_id, void* addr, uint64_t length, kvb_mem_kind_t kind, int32_t device_id) {
  uint32_t flags = 0;
  kvb_region_t r{.struct_size = sizeof(kvb_region_t),
                 .mem_kind = static_cast<uint32_t>(kind),
                 .segment_id = segment_id,
                 .addr = addr,
                 .length = length,
                 .device_id = device_id,
                 .reg_flags = &flags};
  uint8_t rkey[kMaxDescriptorRkey];
  uint32_t rkey_len = 0;
  kvb_status_t st = ops_->register_memory(inst_, &r, rkey, sizeof(rkey), &rkey_len);
  if (st != KVB_OK) {
    return Status::FromAbi(st, "transport '" + name_ + "' refused to register the region");
  }
  if (rkey_len > sizeof(rkey)) {
    (void)ops_->deregister_memory(inst_, segment_id);
    return Status::Internal("transport '" + name_ + "' returned a remote key of " +
                            std::to_string(rkey_len) + " bytes (at most " +
                            std::to_string(sizeof(rkey)) + ")");
  }
  return Registration{.rkey = std::string(reinterpret_cast<const char*>(rkey), rkey_len),
                      .local_only = (flags & KVB_REG_LOCAL_ONLY) != 0};
}

Status TransportInstance::DeregisterMemory(uint64_t segment_id) {
  kvb_status_t st = ops_->deregister_memory(inst_, segment_id);
  return Status::FromAbi(
      st, "transport '" + name_ + "' failed to deregister segment " + std::to_string(segment_id));
}

Result<std::unique_ptr<TransportInstance::Peer>> TransportInstance::AddPeer(const PeerView& peer) {
  PeerInfoAbi abi(peer);
  kvb_tpeer_t* p = nullptr;
  char err[kErrLen] = {0};
  kvb_status_t st = ops_->add_peer(inst_, &abi.info, &p, err, kErrLen);
  if (st != KVB_OK) return FromPlugin(st, err);
  return std::unique_ptr<Peer>(new Peer(this, p));
}

Status TransportInstance::UpdatePeer(Peer& peer, const PeerView& info) {
  PeerInfoAbi abi(info);
  char err[kErrLen] = {0};
  kvb_status_t st = ops_->update_peer(inst_, peer.peer_, &abi.info, err, kErrLen);
  return st == KVB_OK ? Status::OK() : FromPlugin(st, err);
}

Result<std::unique_ptr<TransportInstance::Request>> TransportInstance::Post(
    Peer& peer, std::span<const kvb_xfer_op_t> ops, const PostOptions& options) {
  kvb_post_opts_t popts{.struct_size = sizeof(kvb_post_opts_t),
                        .deadline_ns = options.deadline_ns,
                        .progress_timeout_ns = options.progress_timeout_ns,
                        .on_complete = options.on_complete,
                        .user = options.user};
  kvb_treq_t* req = nullptr;
  char err[kErrLen] = {0};
  const auto n = static_cast<uint32_t>(ops.size());
  kvb_status_t st = ops_->post(inst_, peer.peer_, ops.data(), sizeof(kvb_xfer_op_t), n, &popts,
                               &req, err, kErrLen);
  if (st != KVB_OK) return FromPlugin(st, err);
  return std::unique_ptr<Request>(new Request(this, req, n));
}

TransportInstance::PollResult TransportInstance::Poll(Request& request) {
  PollResult r;
  r.op_codes.assign(request.num_ops_, KVB_IN_PROGRESS);
  char err[kErrLen] = {0};
  kvb_status_t st =
      ops_->poll(inst_, request.req_, r.op_codes.data(), request.num_ops_, err, kErrLen);
  if (st == KVB_IN_PROGRESS) return r;
  r.final = true;
  request.final_ = true;
  r.status = st == KVB_OK ? Status::OK() : FromPlugin(st, err);
  return r;
}

void TransportInstance::Cancel(Request& request) {
  ops_->cancel(inst_, request.req_);
  request.final_ = true;  // cancel makes the request final (ABI)
}

Result<TransportStats> TransportInstance::Stats() const {
  if ((caps_ & KVB_TCAP_STATS) == 0) {
    return Status::Unsupported("transport '" + name_ + "' does not report stats");
  }
  kvb_transport_stats_t s{};
  s.struct_size = sizeof(s);
  kvb_status_t st = ops_->get_stats(inst_, &s);
  if (st != KVB_OK) return Status::FromAbi(st, "get_stats failed");
  TransportStats out;
  out.name = name_;
  out.connections_open = s.connections_open;
  out.connections_opened = s.connections_opened;
  out.connections_closed_idle = s.connections_closed_idle;
  out.connections_evicted = s.connections_evicted;
  out.inbound_open = s.inbound_open;
  out.bytes_written = s.bytes_written;
  out.bytes_read = s.bytes_read;
  out.frames_rejected = s.frames_rejected;
  out.queued_bytes = s.queued_bytes;
  // Zero (as initialized) when the plugin's struct ends before them.
  out.device_regions_direct = s.device_regions_direct;
  out.device_regions_staged = s.device_regions_staged;
  out.device_bytes_staged = s.device_bytes_staged;
  return out;
}

TransportInstance::Peer::~Peer() {
  if (alive_.expired()) return;  // destroy() freed the peer with the instance
  transport_->ops_->remove_peer(transport_->inst_, peer_);
}

TransportInstance::Request::~Request() {
  if (alive_.expired()) return;  // destroy() freed the request with the instance
  if (!final_) transport_->ops_->cancel(transport_->inst_, req_);
  transport_->ops_->release(transport_->inst_, req_);
}

}  // namespace kvbridge::core
