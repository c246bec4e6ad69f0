// The nccl plugin's ABI glue: Probe and Create on the NCCL and CUDA driver found at run time,
// and KVB_TRANSPORT_PLUGIN, which writes the descriptor and the ops table (plugin SDK).
#include <memory>

#include "kvbridge/plugin/sdk/transport.hpp"
#include "nccl_cuda.h"
#include "nccl_loader.h"
#include "nccl_transport.h"

namespace kvbridge::nccl {

sdk::Status Transport::Probe() {
  auto nccl = LoadNcclOnce();
  if (!nccl.ok()) return nccl.status();
  return ProbeNccl(*nccl);
}

sdk::Result<std::unique_ptr<Transport>> Transport::Create(sdk::Host host,
                                                          const kvb_transport_params_t& params) {
  auto nccl = LoadNcclOnce();
  if (!nccl.ok()) return nccl.status();
  if (sdk::Status st = ProbeNccl(*nccl); !st.ok()) return st;
  auto cuda = LoadCudaOpsOnce();
  if (!cuda.ok()) return cuda.status();
  KeepNcclLoaded();  // an instance may outlive this module's static destructors
  return CreateWith(host, params, *nccl, *cuda);
}

}  // namespace kvbridge::nccl

KVB_TRANSPORT_PLUGIN(kvbridge::nccl::Transport)
