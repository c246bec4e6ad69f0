#include "tests/gpu/test_memory.h"

#include <dlfcn.h>

namespace kvbridge::testing {

bool GpuRequired() {
  const char* v = std::getenv("KVBRIDGE_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

const RealDriver* Real(std::string* why) {
  static std::string error;
  static const RealDriver* real = []() -> const RealDriver* {
    Result<const core::cuda::Driver*> d = core::cuda::GetDriver();
    if (!d.ok()) {
      error = d.status().ToString();
      return nullptr;
    }
    static RealDriver r;
    r.d = d.value();
    void* lib = dlopen(core::cuda::DriverLibraryPath().c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (lib != nullptr) {
      r.alloc = reinterpret_cast<decltype(r.alloc)>(dlsym(lib, "cuMemAlloc_v2"));
      r.free = reinterpret_cast<decltype(r.free)>(dlsym(lib, "cuMemFree_v2"));
      r.htod = reinterpret_cast<decltype(r.htod)>(dlsym(lib, "cuMemcpyHtoD_v2"));
      r.dtoh = reinterpret_cast<decltype(r.dtoh)>(dlsym(lib, "cuMemcpyDtoH_v2"));
    }
    if (r.alloc == nullptr || r.free == nullptr || r.htod == nullptr || r.dtoh == nullptr) {
      error = core::cuda::DriverLibraryPath() + " lacks cuMemAlloc_v2/cuMemFree_v2/cuMemcpy*_v2";
      return nullptr;
    }
    if (r.d->cuDeviceGetCount(&r.devices) != 0 || r.devices < 1) {
      error = "the CUDA driver sees no device";
      return nullptr;
    }
    return &r;
  }();
  if (real == nullptr) *why = error;
  return real;
}

}  // namespace kvbridge::testing
