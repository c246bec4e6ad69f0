/*
 * Minimal CUDA runtime access for code that must not include CUDA headers: the kernel tests,
 * the kernel benchmark and tools. Engines and the torch bindings use their own allocators and
 * streams instead. In a build without CUDA every function returns
 * KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA (kvb_cuda_free* do nothing).
 *
 * Results and err follow page_copy.h. All calls act on the current device and are
 * thread-safe as the CUDA runtime is.
 *
 * This header is C99 and depends only on <stddef.h>.
 */
#ifndef KVBRIDGE_KERNELS_CUDA_MEMORY_H_
#define KVBRIDGE_KERNELS_CUDA_MEMORY_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* *count = cudaGetDeviceCount(). KVB_KERNEL_ERR_NO_CUDA_DEVICE when the runtime finds no
 * device or no driver (the message carries the runtime's reason). */
int kvb_cuda_device_count(int* count, char* err, size_t err_len);

/* "NVIDIA H200 (sm_90, 132 SMs)" for the current device into name. */
int kvb_cuda_device_name(char* name, size_t name_len, char* err, size_t err_len);

/* cudaMalloc / cudaFree. */
int kvb_cuda_malloc(void** ptr, size_t bytes, char* err, size_t err_len);
void kvb_cuda_free(void* ptr);

/* Pinned host memory, readable and writable by the GPU (cudaHostAlloc, portable + mapped). */
int kvb_cuda_malloc_host(void** ptr, size_t bytes, char* err, size_t err_len);
void kvb_cuda_free_host(void* ptr);

/* cudaMemcpyAsync(kind = cudaMemcpyDefault) on stream (a cudaStream_t; NULL: legacy default);
 * kvb_cuda_memcpy waits for it. */
int kvb_cuda_memcpy(void* dst, const void* src, size_t bytes, char* err, size_t err_len);
int kvb_cuda_memcpy_async(void* dst, const void* src, size_t bytes, void* stream, char* err,
                          size_t err_len);

/* cudaMemset, synchronous. */
int kvb_cuda_memset(void* ptr, int value, size_t bytes, char* err, size_t err_len);

/* cudaStreamSynchronize(stream); also reports an earlier asynchronous kernel failure. */
int kvb_cuda_stream_synchronize(void* stream, char* err, size_t err_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVBRIDGE_KERNELS_CUDA_MEMORY_H_ */
