// The GPU entry points of a build without CUDA (KVBRIDGE_CUDA=OFF, or AUTO with no nvcc):
// each answers KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA, so callers and tests can tell "no GPU
// path in this build" from "no GPU on this machine".
#include "kernels/common/error.h"
#include "kvbridge/kernels/cuda_memory.h"
#include "kvbridge/kernels/page_copy.h"

using kvb_kernels::Fail;

namespace {

int NotBuilt(char* err, size_t err_len) {
  return Fail(err, err_len, KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA,
              "kvbridge was built without CUDA (KVBRIDGE_CUDA=OFF, or AUTO and CMake found no "
              "nvcc): reconfigure with -DKVBRIDGE_CUDA=ON on a machine with the CUDA toolkit");
}

}  // namespace

extern "C" {

int kvb_page_copy_cuda(const kvb_page_copy_desc*, void*, char* err, size_t err_len) {
  return NotBuilt(err, err_len);
}

int kvb_cuda_device_count(int* count, char* err, size_t err_len) {
  if (count != nullptr) *count = 0;
  return NotBuilt(err, err_len);
}

int kvb_cuda_device_name(char*, size_t, char* err, size_t err_len) {
  return NotBuilt(err, err_len);
}

int kvb_cuda_malloc(void** ptr, size_t, char* err, size_t err_len) {
  if (ptr != nullptr) *ptr = nullptr;
  return NotBuilt(err, err_len);
}

void kvb_cuda_free(void*) {}

int kvb_cuda_malloc_host(void** ptr, size_t, char* err, size_t err_len) {
  if (ptr != nullptr) *ptr = nullptr;
  return NotBuilt(err, err_len);
}

void kvb_cuda_free_host(void*) {}

int kvb_cuda_memcpy(void*, const void*, size_t, char* err, size_t err_len) {
  return NotBuilt(err, err_len);
}

int kvb_cuda_memcpy_async(void*, const void*, size_t, void*, char* err, size_t err_len) {
  return NotBuilt(err, err_len);
}

int kvb_cuda_memset(void*, int, size_t, char* err, size_t err_len) {
  return NotBuilt(err, err_len);
}

int kvb_cuda_stream_synchronize(void*, char* err, size_t err_len) { return NotBuilt(err, err_len); }

}  // extern "C"
