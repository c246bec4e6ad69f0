// The verbs plugin's ABI glue, on the plugin SDK (kvbridge/plugin/sdk/transport.hpp): a class
// that hands each op to verbs::Transport running on libibverbs (MakeIbvApi, MakeIbvRegistrar).
// The SDK writes the descriptor and the ops table and catches at every entry.
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "verbs_discovery.h"
#include "verbs_registrar_ibv.h"
#include "verbs_transport.h"

namespace {

namespace sdk = kvbridge::plugin::sdk;
namespace verbs = kvbridge::verbs;

class VerbsPlugin {
 public:
  static constexpr const char* kName = "verbs";
  static constexpr const char* kVersion = "0.1.0";
  // Not OPT_IN: where a NIC exists it is the fast path. InstanceCaps drops CUDA_DIRECT where no
  // GPUDirect registration path exists (CUDA memory is then staged), and CUDA_MEM as well where
  // staging is off or impossible.
  static constexpr uint64_t kCaps =
      KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT;
  // The side channel authenticates with the host's handshake services (ABI 1.2); instance_caps
  // is 1.3; host staging registers CUDA memory KVB_REG_LOCAL_ONLY (1.5), and the caps say it
  // takes CUDA memory wherever the host has device services.
  static constexpr uint16_t kMinHostMinor = 5;
  using Peer = verbs::Transport::Peer;
  using Request = verbs::Transport::Request;

  static sdk::Status Probe() {
    auto devices = verbs::Discover();
    return devices.ok() ? sdk::Status() : devices.status();
  }

  static sdk::Result<std::unique_ptr<VerbsPlugin>> Create(sdk::Host host,
                                                          const kvb_transport_params_t& params) {
    if (auto st = Probe(); !st.ok()) return st;
    auto api = verbs::MakeIbvApi();
    verbs::Fabric fabric;
    fabric.api = api.get();
    fabric.make_registrar = [](const std::string&, verbs::DeviceHandle, verbs::PdHandle pd) {
      return verbs::MakeIbvRegistrar(pd);
    };
    fabric.cuda_direct = verbs::CudaDirectAvailable();
    fabric.locate = [](uint64_t addr, bool cuda, int device_id) {
      verbs::Location where;
      if (cuda) {
        where.gpu_pci = verbs::CudaPciBusId(device_id);
      } else {
        where.numa_node = verbs::HostNumaNodeOf(addr);
      }
      return where;
    };
    auto t = verbs::Transport::Create(host, params, std::move(fabric));
    if (!t.ok()) return t.status();
    return std::make_unique<VerbsPlugin>(std::move(api), std::move(*t));
  }

  VerbsPlugin(std::unique_ptr<verbs::VerbsApi> api, std::unique_ptr<verbs::Transport> t)
      : api_(std::move(api)), t_(std::move(t)) {}

  std::string Endpoints() { return t_->Endpoints(); }
  sdk::Status RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer& key) {
    return t_->RegisterMemory(r, key);
  }
  sdk::Status DeregisterMemory(uint64_t segment_id) { return t_->DeregisterMemory(segment_id); }
  sdk::Result<Peer*> AddPeer(const sdk::PeerInfo& info) { return t_->AddPeer(info); }
  sdk::Status UpdatePeer(Peer* peer, const sdk::PeerInfo& info) {
    return t_->UpdatePeer(peer, info);
  }
  void RemovePeer(Peer* peer) { t_->RemovePeer(peer); }
  sdk::Result<Request*> Post(Peer* peer, const sdk::Ops& ops, const sdk::PostOptions& opts) {
    return t_->Post(peer, ops, opts);
  }
  sdk::Status Poll(Request* req, std::span<kvb_status_t> op_status) {
    return t_->Poll(req, op_status);
  }
  void Cancel(Request* req) { t_->Cancel(req); }
  void Release(Request* req) { t_->Release(req); }
  sdk::Status Stats(kvb_transport_stats_t& stats) { return t_->Stats(stats); }
  uint64_t InstanceCaps() { return t_->InstanceCaps(); }

 private:
  std::unique_ptr<verbs::VerbsApi> api_;  // declared first: destroyed after the transport
  std::unique_ptr<verbs::Transport> t_;
};

}  // namespace

KVB_TRANSPORT_PLUGIN(VerbsPlugin)
