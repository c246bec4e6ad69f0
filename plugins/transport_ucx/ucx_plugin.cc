// The ucx plugin's ABI glue, on the plugin SDK (kvbridge/plugin/sdk/transport.hpp): a class that
// hands each op to ucx::Transport. The SDK writes the descriptor and the ops table, adds
// KVB_TCAP_STATS for Stats(), and catches at every entry so no C++ exception crosses the ABI.
#include <ucp/api/ucp.h>

#include <memory>
#include <span>
#include <string>
#include <utility>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "ucx_transport.h"

namespace {

namespace sdk = kvbridge::plugin::sdk;
using kvbridge::ucx::Transport;

class UcxPlugin {
 public:
  static constexpr const char* kName = "ucx";
  static constexpr const char* kVersion = "0.1.0";
  // Opt-in: on UCX 1.13 this plugin is slower than tcp on one host and its progress thread costs
  // every process a little, so an engine uses it only when named (docs/transports/ucx.md).
  // CUDA_MEM and CUDA_DIRECT are what the plugin can do with a UCX that has CUDA transports;
  // InstanceCaps drops both where the loaded UCX cannot move device memory here.
  static constexpr uint64_t kCaps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM |
                                    KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT | KVB_TCAP_OPT_IN |
                                    KVB_TCAP_LOCAL_SHM;
  // The hello is the host's identity handshake (ABI 1.2 services): older hosts are refused at
  // load time, and Transport::Create names any service a host leaves NULL.
  static constexpr uint16_t kMinHostMinor = 3;
  using Peer = kvbridge::ucx::Peer;
  using Request = kvbridge::ucx::RequestHandle;

  static sdk::Status Probe() {
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    if (major > 1 || (major == 1 && minor >= 13)) return sdk::Status();
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       "UCX " + std::to_string(major) + "." + std::to_string(minor) +
                           " is loaded; the ucx transport needs 1.13 or newer");
  }

  static sdk::Result<std::unique_ptr<UcxPlugin>> Create(sdk::Host host,
                                                        const kvb_transport_params_t& params) {
    std::unique_ptr<Transport> t;
    std::string msg;
    const kvb_status_t st = Transport::Create(host.raw(), &params, &t, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return std::make_unique<UcxPlugin>(std::move(t));
  }

  explicit UcxPlugin(std::unique_ptr<Transport> t) : t_(std::move(t)) {}

  std::string Endpoints() { return t_->EndpointsText(); }
  sdk::Status RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer& key) {
    std::string rkey, msg;
    const kvb_status_t st = t_->RegisterMemory(r.raw, key.capacity(), &rkey, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return key.Set(sdk::Bytes(reinterpret_cast<const uint8_t*>(rkey.data()), rkey.size()));
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
  uint64_t InstanceCaps() {
    uint64_t caps = ~uint64_t{0};
    if (!t_->cuda_memory()) caps &= ~(KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT);
    // Ranked first for same-host peers only where it reaches them through shared memory.
    if (!t_->same_host_shm()) caps &= ~KVB_TCAP_LOCAL_SHM;
    return caps;
  }

 private:
  std::unique_ptr<Transport> t_;
};

}  // namespace

KVB_TRANSPORT_PLUGIN(UcxPlugin)
