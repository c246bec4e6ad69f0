// Layer 2 on the GPU: kvb_page_copy_cuda checks that a device is there, validates the desc,
// builds the kernel's arguments and launches. Also the small runtime wrappers of
// cuda_memory.h. The only translation unit compiled by nvcc.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>

#include "kernels/common/error.h"
#include "kernels/cuda/page_copy_kernel.cuh"
#include "kernels/cuda/page_copy_params.h"
#include "kvbridge/kernels/cuda_memory.h"
#include "kvbridge/kernels/page_copy.h"

using kvb_kernels::Fail;

namespace {

int CudaFail(char* err, size_t err_len, const char* what, cudaError_t e) {
  return Fail(err, err_len, KVB_KERNEL_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(e),
              cudaGetErrorString(e));
}

// Once a device has been seen, later calls skip the query.
std::atomic<bool> g_device_seen{false};

int CheckDevice(char* err, size_t err_len) {
  if (g_device_seen.load(std::memory_order_relaxed)) return KVB_KERNEL_OK;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky; don't leave it for the caller's next check
    return Fail(err, err_len, KVB_KERNEL_ERR_NO_CUDA_DEVICE,
                "no CUDA device: cudaGetDeviceCount failed: %s (%s)", cudaGetErrorName(e),
                cudaGetErrorString(e));
  }
  if (count == 0) {
    return Fail(err, err_len, KVB_KERNEL_ERR_NO_CUDA_DEVICE,
                "no CUDA device: cudaGetDeviceCount found 0 devices");
  }
  g_device_seen.store(true, std::memory_order_relaxed);
  return KVB_KERNEL_OK;
}

}  // namespace

extern "C" {

int kvb_page_copy_cuda(const kvb_page_copy_desc* desc, void* cuda_stream, char* err,
                       size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  if (int rc = kvb_page_copy_validate(desc, err, err_len); rc != KVB_KERNEL_OK) return rc;
  if (desc->n_pages == 0) return KVB_KERNEL_OK;
  kvb_kernels::cuda::PageCopyParams params{};
  int64_t grid_blocks = 0;
  if (int rc = kvb_kernels::cuda::BuildPageCopyParams(*desc, &params, &grid_blocks, err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  const cudaError_t e = kvb_kernels::cuda::LaunchPageCopy(params, grid_blocks,
                                                          static_cast<cudaStream_t>(cuda_stream));
  if (e != cudaSuccess) return CudaFail(err, err_len, "kvb_page_copy_cuda: kernel launch", e);
  return KVB_KERNEL_OK;
}

int kvb_cuda_device_count(int* count, char* err, size_t err_len) {
  if (count == nullptr) {
    return Fail(err, err_len, KVB_KERNEL_ERR_INVALID_ARGUMENT,
                "kvb_cuda_device_count: count is NULL");
  }
  *count = 0;
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaGetDeviceCount", e);
  return KVB_KERNEL_OK;
}

int kvb_cuda_device_name(char* name, size_t name_len, char* err, size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  int device = 0;
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaGetDeviceProperties", e);
  if (name != nullptr && name_len > 0) {
    std::snprintf(name, name_len, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
                  prop.multiProcessorCount);
  }
  return KVB_KERNEL_OK;
}

int kvb_cuda_malloc(void** ptr, size_t bytes, char* err, size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e = cudaMalloc(ptr, bytes);
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaMalloc", e);
  return KVB_KERNEL_OK;
}

void kvb_cuda_free(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

int kvb_cuda_malloc_host(void** ptr, size_t bytes, char* err, size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaHostAlloc", e);
  return KVB_KERNEL_OK;
}

void kvb_cuda_free_host(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

int kvb_cuda_memcpy_async(void* dst, const void* src, size_t bytes, void* stream, char* err,
                          size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e =
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaMemcpyAsync", e);
  return KVB_KERNEL_OK;
}

int kvb_cuda_memcpy(void* dst, const void* src, size_t bytes, char* err, size_t err_len) {
  if (int rc = kvb_cuda_memcpy_async(dst, src, bytes, nullptr, err, err_len); rc != KVB_KERNEL_OK) {
    return rc;
  }
  return kvb_cuda_stream_synchronize(nullptr, err, err_len);
}

int kvb_cuda_memset(void* ptr, int value, size_t bytes, char* err, size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e = cudaMemset(ptr, value, bytes);
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaMemset", e);
  return kvb_cuda_stream_synchronize(nullptr, err, err_len);
}

int kvb_cuda_stream_synchronize(void* stream, char* err, size_t err_len) {
  if (int rc = CheckDevice(err, err_len); rc != KVB_KERNEL_OK) return rc;
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return CudaFail(err, err_len, "cudaStreamSynchronize", e);
  return KVB_KERNEL_OK;
}

}  // extern "C"
