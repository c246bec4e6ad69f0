// The tcp plugin's ABI glue, on the plugin SDK (kvbridge/plugin/sdk/transport.hpp): a class that
// hands each op to tcp::Transport. The SDK writes the descriptor and the ops table, adds
// KVB_TCAP_STATS for Stats(), and catches at every entry so no C++ exception crosses the ABI.
// Transport reads the ABI structs itself (struct_size, op_size, segment_size), so the raw
// pointers behind the SDK's views are passed through.
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "tcp_transport.h"

namespace {

namespace sdk = kvbridge::plugin::sdk;
using kvbridge::tcp::Transport;

class TcpPlugin {
 public:
  static constexpr const char* kName = "tcp";
  static constexpr const char* kVersion = "0.1.0";
  // CUDA_MEM: device regions move through pinned bounce buffers by the host's ABI 1.2 device
  // services (README.md "Device memory"). The descriptor is static, so the cap is always
  // declared; where the host has no CUDA driver, registering a CUDA region answers the host's
  // UNAVAILABLE (and the engine does not offer it: csrc/core/engine.cc RegisterMemory).
  // OP_CRC32C: a lane checksums an op's bytes as they land or leave, when the op asks
  // (tcp_lane.cc); an instance with tcp.op_checksums=0 drops it (InstanceCaps).
  static constexpr uint64_t kCaps =
      KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM | KVB_TCAP_OP_CRC32C;
  // The handshake is the host's (ABI 1.2 identity and auth services): an older host is refused
  // at load time, naming both versions.
  static constexpr uint16_t kMinHostMinor = 2;
  using Peer = kvbridge::tcp::Peer;
  using Request = kvbridge::tcp::RequestHandle;

  static sdk::Result<std::unique_ptr<TcpPlugin>> Create(sdk::Host host,
                                                        const kvb_transport_params_t& params) {
    std::unique_ptr<Transport> t;
    std::string msg;
    const kvb_status_t st = Transport::Create(host.raw(), &params, &t, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return std::make_unique<TcpPlugin>(std::move(t));
  }

  explicit TcpPlugin(std::unique_ptr<Transport> t) : t_(std::move(t)) {}

  std::string Endpoints() {
    std::string buf(256, '\0');
    int32_t n;
    while ((n = t_->GetEndpoints(buf.data(), static_cast<uint32_t>(buf.size()))) == -2) {
      buf.resize(buf.size() * 2);
    }
    buf.resize(n < 0 ? 0 : static_cast<size_t>(n));
    return buf;
  }
  sdk::Status RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer&) {
    uint32_t rkey_len = 0;  // tcp needs no remote key
    std::string msg;
    const kvb_status_t st = t_->RegisterMemory(r.raw, nullptr, 0, &rkey_len, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return sdk::Status();
  }
  sdk::Status DeregisterMemory(uint64_t segment_id) { return t_->DeregisterMemory(segment_id); }

  sdk::Result<Peer*> AddPeer(const sdk::PeerInfo& info) {
    Peer* peer = nullptr;
    std::string msg;
    const kvb_status_t st = t_->AddPeer(info.raw, &peer, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return peer;
  }
  sdk::Status UpdatePeer(Peer* peer, const sdk::PeerInfo& info) {
    std::string msg;
    const kvb_status_t st = t_->UpdatePeer(peer, info.raw, &msg);
    return sdk::Status(st, std::move(msg));
  }
  void RemovePeer(Peer* peer) { t_->RemovePeer(peer); }

  sdk::Result<Request*> Post(Peer* peer, const sdk::Ops& ops, const sdk::PostOptions& opts) {
    Request* req = nullptr;
    std::string msg;
    const kvb_status_t st = t_->Post(peer, static_cast<const kvb_xfer_op_t*>(ops.data()),
                                     ops.stride(), ops.size(), opts.raw, &req, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return req;
  }
  sdk::Status Poll(Request* req, std::span<kvb_status_t> op_status) {
    char err[512] = "";
    const kvb_status_t st =
        t_->Poll(req, op_status.data(), static_cast<uint32_t>(op_status.size()), err, sizeof(err));
    return sdk::Status(st, err);
  }
  void Cancel(Request* req) { t_->Cancel(req); }
  void Release(Request* req) { t_->Release(req); }
  sdk::Status Stats(kvb_transport_stats_t& stats) { return t_->GetStats(&stats); }
  // The host keeps the descriptor's caps (with the SDK's STATS) that this mask keeps.
  uint64_t InstanceCaps() const {
    return t_->config().op_checksums != 0 ? ~uint64_t{0} : ~KVB_TCAP_OP_CRC32C;
  }

 private:
  std::unique_ptr<Transport> t_;
};

}  // namespace

KVB_TRANSPORT_PLUGIN(TcpPlugin)
