#include "verbs_registrar_ibv.h"

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// The two CUDA driver entry points dma-buf registration needs (libcuda.so.1, never linked).
struct CudaDmaBuf {
  using InitFn = int (*)(unsigned);
  using HandleFn = int (*)(void*, unsigned long long, size_t, int, unsigned long long);
  using DeviceGetFn = int (*)(int*, int);
  using BusIdFn = int (*)(char*, int, int);
  InitFn init = nullptr;
  HandleFn get_handle = nullptr;
  DeviceGetFn device_get = nullptr;
  BusIdFn bus_id = nullptr;
  bool ok = false;

  static const CudaDmaBuf& Get() {
    static const CudaDmaBuf c = [] {
      CudaDmaBuf d;
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) return d;
      d.init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
      d.get_handle = reinterpret_cast<HandleFn>(dlsym(lib, "cuMemGetHandleForAddressRange"));
      d.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
      d.bus_id = reinterpret_cast<BusIdFn>(dlsym(lib, "cuDeviceGetPCIBusId"));
      d.ok = d.init != nullptr && d.get_handle != nullptr && d.init(0) == 0;
      return d;
    }();
    return c;
  }
};

constexpr int kDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD

class IbvRegistrar final : public Registrar {
 public:
  explicit IbvRegistrar(ibv_pd* pd) : pd_(pd) {}

  sdk::Result<MrKeys> Register(uint64_t addr, uint64_t len, bool device, int) override {
    void* p = reinterpret_cast<void*>(addr);
    if (!device) {
      ibv_mr* mr = ibv_reg_mr(pd_, p, len, kAccess);
      if (mr == nullptr) return Failed("ibv_reg_mr", errno);
      return Keys(mr, RegPath::kHost);
    }
    std::string why;
    const CudaDmaBuf& cuda = CudaDmaBuf::Get();
    if (cuda.ok) {
      int fd = -1;
      const int rc = cuda.get_handle(&fd, addr, len, kDmaBufFd, 0);
      if (rc == 0 && fd >= 0) {
        ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, 0, len, addr, fd, kAccess);
        const int err = errno;
        close(fd);
        if (mr != nullptr) return Keys(mr, RegPath::kDmaBuf);
        why = std::string("dma-buf: ibv_reg_dmabuf_mr: ") + std::strerror(err);
      } else {
        why = "dma-buf: cuMemGetHandleForAddressRange failed (CUresult " + std::to_string(rc) + ")";
      }
    } else {
      why = "dma-buf: no CUDA driver with cuMemGetHandleForAddressRange (libcuda.so.1)";
    }
    ibv_mr* mr = ibv_reg_mr(pd_, p, len, kAccess);
    if (mr != nullptr) return Keys(mr, RegPath::kPeerMem);
    why += std::string("; nvidia-peermem: ibv_reg_mr: ") + std::strerror(errno);
    return sdk::Status(KVB_ERR_UNSUPPORTED, why);
  }

  void Deregister(const MrKeys& keys) override {
    ibv_dereg_mr(reinterpret_cast<ibv_mr*>(keys.handle));
  }

 private:
  static sdk::Status Failed(const char* call, int err) {
    return sdk::Status(err == ENOMEM ? KVB_ERR_NO_SPACE : KVB_ERR_IO,
                       std::string(call) + ": " + std::strerror(err));
  }
  static MrKeys Keys(ibv_mr* mr, RegPath path) {
    return MrKeys{mr->lkey, mr->rkey, path, reinterpret_cast<uint64_t>(mr)};
  }

  ibv_pd* pd_;
};

}  // namespace

std::unique_ptr<Registrar> MakeIbvRegistrar(PdHandle pd) {
  return std::make_unique<IbvRegistrar>(static_cast<ibv_pd*>(pd.impl));
}

std::string CudaPciBusId(int device_id) {
  const CudaDmaBuf& cuda = CudaDmaBuf::Get();
  if (!cuda.ok || cuda.device_get == nullptr || cuda.bus_id == nullptr || device_id < 0) return "";
  int dev = 0;
  char buf[32] = "";
  if (cuda.device_get(&dev, device_id) != 0 || cuda.bus_id(buf, sizeof(buf), dev) != 0) return "";
  return buf;
}

bool CudaDirectAvailable() {
  if (!CudaDmaBuf::Get().ok) return false;
  // dma-buf needs nothing more than the driver entry point; peermem needs its module.
  return true;
}

}  // namespace kvbridge::verbs
