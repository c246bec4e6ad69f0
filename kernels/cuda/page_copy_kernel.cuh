// Layer 1 of the page copy: the kernel, on raw pointers and byte strides, no validation.
// kvb_page_copy_cuda (page_copy.cu) validates a kvb_page_copy_desc, turns it into
// PageCopyParams (page_copy_params.cc) and calls LaunchPageCopy.
//
// The work is n_pages * n_layers * n_kv chunks of rows x row_bytes. A block of
// kThreadsPerBlock threads takes chunks_per_block chunks at a time (one group of threads per
// chunk; a warp for small chunks, the whole block for large ones) and strides over the grid.
// Within a chunk, threads walk the bytes with the widest access (16, 8, 4 or 1 bytes) that both
// addresses, both row strides and row_bytes allow, four accesses in flight per thread. Chunks
// whose rows are contiguous on both sides are copied as one run.
//
// Everything but the __global__ wrapper is host-compilable too: tests run PageCopyThread for
// every (block, thread) on the CPU (no shared memory, no barriers, so that is exact).
#ifndef KVBRIDGE_KERNELS_CUDA_PAGE_COPY_KERNEL_CUH_
#define KVBRIDGE_KERNELS_CUDA_PAGE_COPY_KERNEL_CUH_

#include <cstdint>
#include <cstring>

#include "kvbridge/kernels/page_copy.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define KVB_HD __host__ __device__ __forceinline__
#else
#define KVB_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define KVB_UNROLL _Pragma("unroll")
#else
#define KVB_UNROLL
#endif

namespace kvb_kernels::cuda {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxInlinePtrs = KVB_PAGE_COPY_CUDA_INLINE_PTRS;
constexpr int kUnroll = 4;  // accesses in flight per thread

struct SideParams {
  const char* base;          // base mode
  const char* const* table;  // a GPU-readable pointer table, or nullptr
  int64_t table_kv_stride;   // entries between kv parts (table or inline entries)
  int64_t kv_stride;         // bytes
  int64_t layer_stride;      // bytes, base mode
  int64_t page_stride;       // bytes
  int64_t row_stride;        // bytes
  int64_t num_pages;         // 0: unchecked
  int32_t inline_offset;     // >= 0: the table is PageCopyParams::inline_ptrs from here
};

// Passed by value as the kernel's argument (__grid_constant__, so never copied per thread).
struct PageCopyParams {
  SideParams src;
  SideParams dst;
  const int64_t* src_pages;
  const int64_t* dst_pages;
  int64_t n_pages;
  int64_t n_layers;
  int64_t n_kv;
  int64_t rows;
  int64_t row_bytes;
  int32_t chunks_per_block;  // divides kThreadsPerBlock
  const char* inline_ptrs[kMaxInlinePtrs];
};
// The classic 4 KiB kernel-argument limit, with room to spare.
static_assert(sizeof(PageCopyParams) <= 4000, "PageCopyParams must fit in 4 KiB of arguments");

#if defined(__CUDACC__)
using Vec16 = uint4;
using Vec8 = uint2;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
struct alignas(8) Vec8 {
  uint32_t x, y;
};
#endif
using Vec4 = uint32_t;
using Vec1 = uint8_t;

template <typename V>
KVB_HD V LoadVec(const char* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(reinterpret_cast<const V*>(p));
#else
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
#endif
}

template <typename V>
KVB_HD void StoreVec(char* p, const V& v) {
#if defined(__CUDA_ARCH__)
  __stcg(reinterpret_cast<V*>(p), v);  // the copy is not read back soon: keep it out of L1
#else
  std::memcpy(p, &v, sizeof(V));
#endif
}

// One contiguous run of n vectors.
template <typename V, typename Index>
KVB_HD void CopyRun(const char* src, char* dst, Index n, Index lane, Index group) {
  for (Index first = lane; first < n; first += group * kUnroll) {
    V v[kUnroll];
    KVB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const Index k = first + u * group;
      if (k < n) v[u] = LoadVec<V>(src + k * sizeof(V));
    }
    KVB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const Index k = first + u * group;
      if (k < n) StoreVec<V>(dst + k * sizeof(V), v[u]);
    }
  }
}

// rows rows of per_row vectors each, at the given byte strides.
template <typename V, typename Index>
KVB_HD void CopyRows(const char* src, char* dst, Index rows, Index per_row, int64_t src_stride,
                     int64_t dst_stride, Index lane, Index group) {
  const Index n = rows * per_row;
  for (Index first = lane; first < n; first += group * kUnroll) {
    V v[kUnroll];
    KVB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const Index k = first + u * group;
      if (k < n) {
        const Index r = k / per_row;
        const Index c = k - r * per_row;
        v[u] = LoadVec<V>(src + static_cast<int64_t>(r) * src_stride + c * sizeof(V));
      }
    }
    KVB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const Index k = first + u * group;
      if (k < n) {
        const Index r = k / per_row;
        const Index c = k - r * per_row;
        StoreVec<V>(dst + static_cast<int64_t>(r) * dst_stride + c * sizeof(V), v[u]);
      }
    }
  }
}

template <typename V>
KVB_HD void CopyChunkAs(const char* src, char* dst, int64_t rows, int64_t row_bytes,
                        int64_t src_stride, int64_t dst_stride, int lane, int group) {
  const int64_t per_row = row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t n = rows * per_row;
  // 32-bit index arithmetic whenever the chunk allows it (fewer registers, cheap division).
  const bool small = n + static_cast<int64_t>(group) * kUnroll < (int64_t{1} << 31);
  if (rows == 1) {
    if (small) {
      CopyRun<V, uint32_t>(src, dst, static_cast<uint32_t>(n), lane, group);
    } else {
      CopyRun<V, int64_t>(src, dst, n, lane, group);
    }
  } else if (small) {
    CopyRows<V, uint32_t>(src, dst, static_cast<uint32_t>(rows), static_cast<uint32_t>(per_row),
                          src_stride, dst_stride, lane, group);
  } else {
    // Chunks of 2^31 accesses or more: row by row, which avoids 64-bit division.
    for (int64_t r = 0; r < rows; ++r) {
      CopyRun<V, int64_t>(src + r * src_stride, dst + r * dst_stride, per_row, lane, group);
    }
  }
}

KVB_HD void CopyChunk(const char* src, char* dst, int64_t rows, int64_t row_bytes,
                      int64_t src_stride, int64_t dst_stride, int lane, int group) {
  if (src_stride == row_bytes && dst_stride == row_bytes) {
    row_bytes *= rows;
    rows = 1;
  }
  uint64_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
               static_cast<uint64_t>(row_bytes);
  if (rows > 1) a |= static_cast<uint64_t>(src_stride) | static_cast<uint64_t>(dst_stride);
  if ((a & 15) == 0) {
    CopyChunkAs<Vec16>(src, dst, rows, row_bytes, src_stride, dst_stride, lane, group);
  } else if ((a & 7) == 0) {
    CopyChunkAs<Vec8>(src, dst, rows, row_bytes, src_stride, dst_stride, lane, group);
  } else if ((a & 3) == 0) {
    CopyChunkAs<Vec4>(src, dst, rows, row_bytes, src_stride, dst_stride, lane, group);
  } else {
    CopyChunkAs<Vec1>(src, dst, rows, row_bytes, src_stride, dst_stride, lane, group);
  }
}

KVB_HD const char* Plane(const PageCopyParams& p, const SideParams& s, int64_t kv, int64_t layer) {
  const char* base;
  if (s.inline_offset >= 0) {
    base = p.inline_ptrs[s.inline_offset + kv * s.table_kv_stride + layer];
  } else if (s.table != nullptr) {
    base = s.table[kv * s.table_kv_stride + layer];
  } else {
    base = s.base + layer * s.layer_stride;
  }
  return base + kv * s.kv_stride;
}

KVB_HD bool Skipped(int64_t page, int64_t num_pages) {
  return page < 0 || (num_pages > 0 && page >= num_pages);
}

// What thread `thread` of block `block` in a grid of `grid` blocks does.
KVB_HD void PageCopyThread(const PageCopyParams& p, int64_t block, int thread, int64_t grid) {
  const int group = kThreadsPerBlock / p.chunks_per_block;
  const int lane = thread % group;
  const int64_t n_chunks = p.n_pages * p.n_layers * p.n_kv;
  const int64_t step = grid * p.chunks_per_block;
  for (int64_t c = block * p.chunks_per_block + thread / group; c < n_chunks; c += step) {
    const int64_t kv = c % p.n_kv;
    const int64_t rest = c / p.n_kv;
    const int64_t layer = rest % p.n_layers;
    const int64_t i = rest / p.n_layers;
    const int64_t sp = p.src_pages[i];
    const int64_t dp = p.dst_pages[i];
    if (Skipped(sp, p.src.num_pages) || Skipped(dp, p.dst.num_pages)) continue;
    const char* src = Plane(p, p.src, kv, layer) + sp * p.src.page_stride;
    char* dst = const_cast<char*>(Plane(p, p.dst, kv, layer)) + dp * p.dst.page_stride;
    CopyChunk(src, dst, p.rows, p.row_bytes, p.src.row_stride, p.dst.row_stride, lane, group);
  }
}

#if defined(__CUDACC__)
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    PageCopyKernel(const __grid_constant__ PageCopyParams p) {
  PageCopyThread(p, blockIdx.x, static_cast<int>(threadIdx.x), gridDim.x);
}

// Enqueues the kernel; returns the launch's error (cudaSuccess when it was enqueued).
inline cudaError_t LaunchPageCopy(const PageCopyParams& p, int64_t grid_blocks,
                                  cudaStream_t stream) {
  PageCopyKernel<<<static_cast<unsigned>(grid_blocks), kThreadsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}
#endif

}  // namespace kvb_kernels::cuda

#endif  // KVBRIDGE_KERNELS_CUDA_PAGE_COPY_KERNEL_CUH_
