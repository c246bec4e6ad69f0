// CudaDriver: the CUDA driver API, loaded at run time with dlopen so that libkvbridge builds and
// runs without the CUDA toolkit or a GPU. Loaded once per process (std::call_once) from
// $KVBRIDGE_CUDA_DRIVER (test/dev only: tests point it at a fake driver) else libcuda.so.1;
// entry points come from cuGetProcAddress where the driver has it, else from dlsym of the
// versioned (_v2) names. Without a driver every user gets the same cached
// UNAVAILABLE("no CUDA driver (libcuda.so.1): <dlerror>"). The few CUDA types and enum values
// used are declared here (values as in the driver API's cuda.h), so no cuda.h is needed to build.
// Thread-safe: Get() may be called from any thread; the table is immutable once loaded, and the
// driver's entry points are themselves thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::core::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's own type
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

inline constexpr CUresult kSuccess = 0;
inline constexpr CUresult kErrorInvalidValue = 1;      // CUDA_ERROR_INVALID_VALUE
inline constexpr CUresult kErrorInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT
inline constexpr CUresult kErrorNotReady = 600;        // CUDA_ERROR_NOT_READY

// CUpointer_attribute values.
inline constexpr int kAttrMemoryType = 2;
inline constexpr int kAttrIsManaged = 8;
inline constexpr int kAttrDeviceOrdinal = 9;
inline constexpr int kAttrRangeStartAddr = 11;
inline constexpr int kAttrRangeSize = 12;
// CUmemorytype values.
inline constexpr unsigned kMemoryTypeHost = 1;
inline constexpr unsigned kMemoryTypeDevice = 2;
inline constexpr unsigned kMemoryTypeUnified = 4;
inline constexpr unsigned kStreamNonBlocking = 0x1;     // CU_STREAM_NON_BLOCKING
inline constexpr unsigned kEventDisableTiming = 0x2;    // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned kMemHostAllocPortable = 0x1;  // CU_MEMHOSTALLOC_PORTABLE

struct Driver {
  std::string path;  // what was dlopened
  int version = 0;   // cuDriverGetVersion, e.g. 13000

  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuPointerGetAttributes)(unsigned, int*, void**, CUdeviceptr) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;

  // "CUDA_ERROR_INVALID_VALUE (1)"; "CUDA error 1" when the driver cannot name it.
  std::string ErrorName(CUresult r) const;
  // OK, or IO_ERROR "<what>: <ErrorName(r)>".
  Status Check(CUresult r, const std::string& what) const;
};

// The loaded driver, or the cached UNAVAILABLE naming the library and dlerror(). The first call
// loads (and cuInit(0)s) it; later calls return the same answer.
Result<const Driver*> GetDriver();

// The driver if this process already has it: loaded by GetDriver() before, or mapped by someone
// else (a framework that uses CUDA; then it is loaded here too). nullptr otherwise, and nothing
// is loaded: host-memory registration uses it so that a process without CUDA never pays for
// loading the driver.
const Driver* DriverIfPresent();

// The default library: libcuda.so.1, or $KVBRIDGE_CUDA_DRIVER when set.
std::string DriverLibraryPath();

// Makes `device`'s primary context current on this thread for the scope (retained while held).
class ScopedDeviceContext {
 public:
  ScopedDeviceContext(const Driver& d, int device);
  ~ScopedDeviceContext();
  ScopedDeviceContext(const ScopedDeviceContext&) = delete;
  ScopedDeviceContext& operator=(const ScopedDeviceContext&) = delete;
  const Status& status() const { return status_; }

 private:
  const Driver& d_;
  CUdevice dev_ = 0;
  bool retained_ = false;
  bool pushed_ = false;
  Status status_;
};

// A non-blocking stream on `device`'s primary context, which it keeps retained while it lives
// (memory and events made on that context stay usable as long as it exists). Create and the
// destructor make the context current only around their own driver calls. The destructor does
// not wait for queued work: the owner drains the stream first.
class DeviceStream {
 public:
  // Errors name `what` and the failed call: "<what>: cuStreamCreate: CUDA_ERROR_...".
  static Result<std::unique_ptr<DeviceStream>> Create(const Driver& d, int device,
                                                      std::string_view what);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  CUstream get() const { return stream_; }
  int device() const { return device_; }

 private:
  DeviceStream(const Driver& d, int device) : d_(d), device_(device) {}
  const Driver& d_;
  int device_;
  CUdevice dev_ = 0;
  bool retained_ = false;
  CUstream stream_ = nullptr;
};

}  // namespace kvbridge::core::cuda
