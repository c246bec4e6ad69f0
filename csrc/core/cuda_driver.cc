#include "core/cuda_driver.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace kvbridge::core::cuda {
namespace {

constexpr const char* kDefaultLibrary = "libcuda.so.1";

struct Loaded {
  std::unique_ptr<Driver> driver;  // set on success
  Status error;                    // set on failure
};

std::once_flag g_once;
std::atomic<bool> g_attempted{false};
Loaded* g_loaded = nullptr;  // built once, never freed (the driver stays mapped)

// cuGetProcAddress_v2 (CUDA >= 12.0) and cuGetProcAddress (11.3 .. 12.x).
using GetProcV2 = CUresult (*)(const char*, void**, int, uint64_t, int*);
using GetProcV1 = CUresult (*)(const char*, void**, int, uint64_t);

class SymbolSource {
 public:
  explicit SymbolSource(void* lib) : lib_(lib) {
    v2_ = reinterpret_cast<GetProcV2>(dlsym(lib, "cuGetProcAddress_v2"));
    if (v2_ == nullptr) v1_ = reinterpret_cast<GetProcV1>(dlsym(lib, "cuGetProcAddress"));
  }
  // `base` through cuGetProcAddress at the ABI the prototypes in cuda_driver.h were written
  // against; else dlsym(`versioned`), the exported name of that ABI.
  template <typename Fn>
  bool Get(Fn* out, const char* base, const char* versioned) {
    void* p = nullptr;
    int status = 0;
    if (v2_ != nullptr) {
      if (v2_(base, &p, 12000, 0, &status) != kSuccess) p = nullptr;
    } else if (v1_ != nullptr) {
      if (v1_(base, &p, 11030, 0) != kSuccess) p = nullptr;
    }
    if (p == nullptr) p = dlsym(lib_, versioned);
    *out = reinterpret_cast<Fn>(p);
    if (p == nullptr && missing_.empty()) missing_ = versioned;
    return p != nullptr;
  }
  const std::string& missing() const { return missing_; }

 private:
  void* lib_;
  GetProcV2 v2_ = nullptr;
  GetProcV1 v1_ = nullptr;
  std::string missing_;
};

Loaded* Load() {
  auto* out = new Loaded;
  const std::string path = DriverLibraryPath();
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out->error =
        Status::Unavailable("no CUDA driver (" + path + "): " + (why ? why : "dlopen failed"));
    return out;
  }
  auto d = std::make_unique<Driver>();
  d->path = path;
  // cuInit and cuDriverGetVersion are unversioned and come first, straight from the library.
  d->cuInit = reinterpret_cast<decltype(d->cuInit)>(dlsym(lib, "cuInit"));
  d->cuDriverGetVersion =
      reinterpret_cast<decltype(d->cuDriverGetVersion)>(dlsym(lib, "cuDriverGetVersion"));
  if (d->cuInit == nullptr || d->cuDriverGetVersion == nullptr) {
    out->error = Status::Unavailable("CUDA driver " + path + " lacks cuInit/cuDriverGetVersion");
    return out;
  }
  SymbolSource s(lib);
  s.Get(&d->cuGetErrorName, "cuGetErrorName", "cuGetErrorName");
  const CUresult init = d->cuInit(0);
  if (init != kSuccess) {
    out->error =
        Status::Unavailable("CUDA driver " + path + ": cuInit failed: " + d->ErrorName(init));
    return out;
  }
  (void)d->cuDriverGetVersion(&d->version);
  s.Get(&d->cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount");
  s.Get(&d->cuDeviceGet, "cuDeviceGet", "cuDeviceGet");
  s.Get(&d->cuPointerGetAttributes, "cuPointerGetAttributes", "cuPointerGetAttributes");
  s.Get(&d->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
  s.Get(&d->cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2");
  s.Get(&d->cuCtxPushCurrent, "cuCtxPushCurrent", "cuCtxPushCurrent_v2");
  s.Get(&d->cuCtxPopCurrent, "cuCtxPopCurrent", "cuCtxPopCurrent_v2");
  s.Get(&d->cuStreamCreate, "cuStreamCreate", "cuStreamCreate");
  s.Get(&d->cuStreamDestroy, "cuStreamDestroy", "cuStreamDestroy_v2");
  s.Get(&d->cuMemcpyAsync, "cuMemcpyAsync", "cuMemcpyAsync");
  s.Get(&d->cuEventCreate, "cuEventCreate", "cuEventCreate");
  s.Get(&d->cuEventRecord, "cuEventRecord", "cuEventRecord");
  s.Get(&d->cuEventQuery, "cuEventQuery", "cuEventQuery");
  s.Get(&d->cuEventSynchronize, "cuEventSynchronize", "cuEventSynchronize");
  s.Get(&d->cuEventDestroy, "cuEventDestroy", "cuEventDestroy_v2");
  s.Get(&d->cuMemHostAlloc, "cuMemHostAlloc", "cuMemHostAlloc");
  s.Get(&d->cuMemFreeHost, "cuMemFreeHost", "cuMemFreeHost");
  if (!s.missing().empty()) {
    out->error = Status::Unavailable("CUDA driver " + path + " lacks " + s.missing());
    return out;
  }
  out->driver = std::move(d);  // the library stays loaded for the life of the process
  return out;
}

}  // namespace

std::string DriverLibraryPath() {
  const char* env = std::getenv("KVBRIDGE_CUDA_DRIVER");
  return env != nullptr && env[0] != '\0' ? env : kDefaultLibrary;
}

Result<const Driver*> GetDriver() {
  std::call_once(g_once, [] {
    g_loaded = Load();
    g_attempted.store(true, std::memory_order_release);
  });
  if (g_loaded->driver) return static_cast<const Driver*>(g_loaded->driver.get());
  return g_loaded->error;
}

const Driver* DriverIfPresent() {
  if (!g_attempted.load(std::memory_order_acquire)) {
    void* mapped = dlopen(DriverLibraryPath().c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (mapped == nullptr) return nullptr;
    dlclose(mapped);  // drops only the reference RTLD_NOLOAD took
  }
  Result<const Driver*> d = GetDriver();
  return d.ok() ? d.value() : nullptr;
}

std::string Driver::ErrorName(CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(r, &name) == kSuccess && name != nullptr) {
    return std::string(name) + " (" + std::to_string(r) + ")";
  }
  return "CUDA error " + std::to_string(r);
}

Status Driver::Check(CUresult r, const std::string& what) const {
  if (r == kSuccess) return Status::OK();
  return Status::IoError(what + ": " + ErrorName(r));
}

ScopedDeviceContext::ScopedDeviceContext(const Driver& d, int device) : d_(d) {
  status_ = d_.Check(d_.cuDeviceGet(&dev_, device), "cuDeviceGet(" + std::to_string(device) + ")");
  if (!status_.ok()) return;
  CUcontext ctx = nullptr;
  status_ = d_.Check(d_.cuDevicePrimaryCtxRetain(&ctx, dev_),
                     "cuDevicePrimaryCtxRetain(device " + std::to_string(device) + ")");
  if (!status_.ok()) return;
  retained_ = true;
  status_ = d_.Check(d_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
  pushed_ = status_.ok();
}

ScopedDeviceContext::~ScopedDeviceContext() {
  if (pushed_) {
    CUcontext popped = nullptr;
    (void)d_.cuCtxPopCurrent(&popped);
  }
  if (retained_) (void)d_.cuDevicePrimaryCtxRelease(dev_);
}

Result<std::unique_ptr<DeviceStream>> DeviceStream::Create(const Driver& d, int device,
                                                           std::string_view what) {
  std::unique_ptr<DeviceStream> s(new DeviceStream(d, device));
  const std::string where = std::string(what) + ": ";
  ScopedDeviceContext ctx(d, device);
  KVB_RETURN_IF_ERROR(ctx.status().WithContext(what));
  KVB_RETURN_IF_ERROR(d.Check(d.cuDeviceGet(&s->dev_, device), where + "cuDeviceGet"));
  CUcontext primary = nullptr;
  KVB_RETURN_IF_ERROR(
      d.Check(d.cuDevicePrimaryCtxRetain(&primary, s->dev_), where + "cuDevicePrimaryCtxRetain"));
  s->retained_ = true;
  KVB_RETURN_IF_ERROR(
      d.Check(d.cuStreamCreate(&s->stream_, kStreamNonBlocking), where + "cuStreamCreate"));
  return s;
}

DeviceStream::~DeviceStream() {
  if (stream_ != nullptr) {
    ScopedDeviceContext ctx(d_, device_);
    (void)d_.cuStreamDestroy(stream_);
  }
  if (retained_) (void)d_.cuDevicePrimaryCtxRelease(dev_);
}

}  // namespace kvbridge::core::cuda
