// kvbridge::verbs::MakeIbvRegistrar: the Registrar (verbs_mr_cache.h) of the real plugin, on one
// ibv_pd. Host memory: ibv_reg_mr. CUDA memory, in this order: dma-buf (the CUDA driver's
// cuMemGetHandleForAddressRange, from libcuda.so.1 loaded at run time, then ibv_reg_dmabuf_mr),
// nvidia-peermem (ibv_reg_mr on the device pointer). When both fail Register returns
// UNSUPPORTED naming each path and why, and the transport stages that region through host
// memory instead (verbs_transport.h, "Host staging"). CudaDirectAvailable says
// whether either GPU path can exist here (a CUDA driver, and dma-buf or the nvidia_peermem
// module); CudaPciBusId places a GPU for rail choice. Thread-safety: MrCache calls a Registrar
// under its mutex; the CUDA entry points are resolved once, thread-safely.
#pragma once

#include <memory>
#include <string>

#include "verbs_api.h"
#include "verbs_mr_cache.h"

namespace kvbridge::verbs {

std::unique_ptr<Registrar> MakeIbvRegistrar(PdHandle pd);
bool CudaDirectAvailable();
// The PCI bus id of CUDA device `device_id` ("0000:18:00.0"), "" without a driver.
std::string CudaPciBusId(int device_id);

}  // namespace kvbridge::verbs
