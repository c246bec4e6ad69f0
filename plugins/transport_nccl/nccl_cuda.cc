#include "nccl_cuda.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>

namespace kvbridge::nccl {
namespace {

// The driver's own entry points (CUresult is an int enum; handles are pointers).
struct Driver {
  int (*cuInit)(unsigned) = nullptr;
  int (*cuDeviceGet)(int*, int) = nullptr;
  int (*cuDevicePrimaryCtxRetain)(void**, int) = nullptr;
  int (*cuCtxSetCurrent)(void*) = nullptr;
  int (*cuStreamCreate)(void**, unsigned) = nullptr;
  int (*cuStreamDestroy)(void*) = nullptr;
  int (*cuEventCreate)(void**, unsigned) = nullptr;
  int (*cuEventRecord)(void*, void*) = nullptr;
  int (*cuEventQuery)(void*) = nullptr;
  int (*cuEventDestroy)(void*) = nullptr;
  int (*cuGetErrorName)(int, const char**) = nullptr;
};

Driver g_driver;  // filled once by LoadCudaOpsOnce, read-only afterwards

constexpr unsigned kStreamNonBlocking = 1;   // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING

int UseDevice(int device) {
  int dev = 0;
  if (int r = g_driver.cuDeviceGet(&dev, device); r != 0) return r;
  void* ctx = nullptr;
  if (int r = g_driver.cuDevicePrimaryCtxRetain(&ctx, dev); r != 0) return r;
  return g_driver.cuCtxSetCurrent(ctx);
}
int StreamCreate(cudaStream_t* out) { return g_driver.cuStreamCreate(out, kStreamNonBlocking); }
int StreamDestroy(cudaStream_t s) { return g_driver.cuStreamDestroy(s); }
int EventCreate(CudaEvent* out) { return g_driver.cuEventCreate(out, kEventDisableTiming); }
int EventRecord(CudaEvent e, cudaStream_t s) { return g_driver.cuEventRecord(e, s); }
int EventQuery(CudaEvent e) { return g_driver.cuEventQuery(e); }
int EventDestroy(CudaEvent e) { return g_driver.cuEventDestroy(e); }
const char* ErrorName(int r) {
  const char* name = nullptr;
  if (g_driver.cuGetErrorName == nullptr || g_driver.cuGetErrorName(r, &name) != 0) return nullptr;
  return name;
}

template <typename Fn>
void Bind(void* lib, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr && missing->empty()) *missing = name;
}

sdk::Result<const CudaOps*> Load() {
  const char* env = std::getenv("KVBRIDGE_CUDA_DRIVER");
  const std::string path = env != nullptr && env[0] != '\0' ? env : "libcuda.so.1";
  dlerror();
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: no CUDA driver (" + path + ": " +
                                                (why != nullptr ? why : "dlopen failed") + ")");
  }
  std::string missing;
  Bind(lib, "cuInit", &g_driver.cuInit, &missing);
  Bind(lib, "cuDeviceGet", &g_driver.cuDeviceGet, &missing);
  Bind(lib, "cuDevicePrimaryCtxRetain", &g_driver.cuDevicePrimaryCtxRetain, &missing);
  Bind(lib, "cuCtxSetCurrent", &g_driver.cuCtxSetCurrent, &missing);
  Bind(lib, "cuStreamCreate", &g_driver.cuStreamCreate, &missing);
  Bind(lib, "cuStreamDestroy_v2", &g_driver.cuStreamDestroy, &missing);
  Bind(lib, "cuEventCreate", &g_driver.cuEventCreate, &missing);
  Bind(lib, "cuEventRecord", &g_driver.cuEventRecord, &missing);
  Bind(lib, "cuEventQuery", &g_driver.cuEventQuery, &missing);
  Bind(lib, "cuEventDestroy_v2", &g_driver.cuEventDestroy, &missing);
  Bind(lib, "cuGetErrorName", &g_driver.cuGetErrorName, &missing);
  if (!missing.empty()) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: the CUDA driver " + path + " lacks " + missing);
  }
  if (const int r = g_driver.cuInit(0); r != 0) {
    const char* name = ErrorName(r);
    return sdk::Status(KVB_ERR_UNAVAILABLE, "nccl: the CUDA driver " + path +
                                                " cannot start: cuInit(0) failed: " +
                                                (name != nullptr ? name : std::to_string(r)));
  }
  auto ops = std::make_unique<CudaOps>();
  ops->path = path;
  ops->use_device = UseDevice;
  ops->stream_create = StreamCreate;
  ops->stream_destroy = StreamDestroy;
  ops->event_create = EventCreate;
  ops->event_record = EventRecord;
  ops->event_query = EventQuery;
  ops->event_destroy = EventDestroy;
  ops->error_name = ErrorName;
  return static_cast<const CudaOps*>(ops.release());  // as the driver: for the process's life
}

}  // namespace

std::string CudaOps::ErrorString(int r) const {
  const char* name = error_name != nullptr ? error_name(r) : nullptr;
  if (name != nullptr) return std::string(name) + " (" + std::to_string(r) + ")";
  return "CUDA error " + std::to_string(r);
}

sdk::Result<const CudaOps*> LoadCudaOpsOnce() {
  static const sdk::Result<const CudaOps*> loaded = Load();
  return loaded;
}

}  // namespace kvbridge::nccl
