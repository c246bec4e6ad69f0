// kvbridge::nccl::CudaOps: the few CUDA driver calls the NCCL transport makes itself (a stream
// per communicator, events to learn when an ncclSend/ncclRecv queued on it has finished), as a
// table of function pointers so tests can hand the transport a fake (tests/nccl/fake_nccl.h).
// LoadCudaOps() fills it from the CUDA driver, dlopen'd at run time like the core does
// (csrc/core/cuda_driver.cc; a plugin never links the core nor libcuda): $KVBRIDGE_CUDA_DRIVER
// when set, else libcuda.so.1. Driver streams are what NCCL calls cudaStream_t.
//
// Thread-safety: the table is immutable; the calls have the driver's rules (a context must be
// current on the calling thread: UseDevice does that once per thread).
#pragma once

#include <string>

#include "kvbridge/plugin/sdk/common.hpp"
#include "nccl_loader.h"

namespace kvbridge::nccl {

using CudaEvent = void*;  // CUevent

struct CudaOps {
  std::string path;  // the driver library, for messages ("fake" in tests)
  // Every call returns a CUresult: 0 is success; 600 (CUDA_ERROR_NOT_READY) from event_query
  // means the work the event covers has not finished yet.
  // Makes device `device`'s primary context current on the calling thread.
  int (*use_device)(int device) = nullptr;
  int (*stream_create)(cudaStream_t* out) = nullptr;
  int (*stream_destroy)(cudaStream_t s) = nullptr;
  int (*event_create)(CudaEvent* out) = nullptr;
  int (*event_record)(CudaEvent e, cudaStream_t s) = nullptr;
  int (*event_query)(CudaEvent e) = nullptr;
  int (*event_destroy)(CudaEvent e) = nullptr;
  // "CUDA_ERROR_INVALID_VALUE"; NULL when unknown. May be NULL itself.
  const char* (*error_name)(int r) = nullptr;

  // "CUDA_ERROR_X (n)" or "CUDA error n".
  std::string ErrorString(int r) const;
};

inline constexpr int kCudaSuccess = 0;
inline constexpr int kCudaNotReady = 600;

// Loads the driver and binds every call, once per process; UNAVAILABLE naming the library and
// what it lacks or why it did not load.
sdk::Result<const CudaOps*> LoadCudaOpsOnce();

}  // namespace kvbridge::nccl
