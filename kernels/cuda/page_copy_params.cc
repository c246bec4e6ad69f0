#include "kernels/cuda/page_copy_params.h"

#include <algorithm>
#include <cinttypes>

#include "kernels/common/error.h"

namespace kvb_kernels::cuda {
namespace {

// Grid-stride loop beyond this many blocks.
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

int FillSide(const char* name, const kvb_page_side& s, const kvb_page_copy_desc& d,
             PageCopyParams* p, int* inline_used, SideParams* out, char* err, size_t err_len) {
  *out = SideParams{};
  out->inline_offset = -1;
  out->kv_stride = s.kv_stride_bytes;
  out->page_stride = s.page_stride_bytes;
  out->row_stride = s.row_stride_bytes;
  out->num_pages = s.num_pages;
  if (s.layer_ptrs_device != nullptr) {
    out->table = reinterpret_cast<const char* const*>(s.layer_ptrs_device);
    out->table_kv_stride = s.table_kv_stride;
    return KVB_KERNEL_OK;
  }
  if (s.layer_ptrs == nullptr) {
    out->base = static_cast<const char*>(s.base);
    out->layer_stride = s.layer_stride_bytes;
    return KVB_KERNEL_OK;
  }
  const int64_t needed = d.n_kv * d.n_layers;
  if (*inline_used + needed > kMaxInlinePtrs) {
    return Fail(err, err_len, KVB_KERNEL_ERR_INVALID_ARGUMENT,
                "%s.layer_ptrs needs %" PRId64
                " entries in the kernel's arguments and %d are "
                "taken; they hold %d (KVB_PAGE_COPY_CUDA_INLINE_PTRS): set %s.layer_ptrs_device "
                "to a GPU-readable copy of the table",
                name, needed, *inline_used, kMaxInlinePtrs, name);
  }
  // Packed as [kv * n_layers + layer], whatever the host table's kv stride.
  out->inline_offset = *inline_used;
  out->table_kv_stride = d.n_layers;
  for (int64_t kv = 0; kv < d.n_kv; ++kv) {
    for (int64_t layer = 0; layer < d.n_layers; ++layer) {
      const int64_t e = kv * s.table_kv_stride + layer;
      if (s.layer_ptrs[e] == nullptr) {
        return Fail(err, err_len, KVB_KERNEL_ERR_INVALID_ARGUMENT,
                    "%s.layer_ptrs[%" PRId64 "] (kv %" PRId64 ", layer %" PRId64 ") is NULL", name,
                    e, kv, layer);
      }
      p->inline_ptrs[*inline_used + kv * d.n_layers + layer] =
          static_cast<const char*>(s.layer_ptrs[e]);
    }
  }
  *inline_used += static_cast<int>(needed);
  return KVB_KERNEL_OK;
}

}  // namespace

int BuildPageCopyParams(const kvb_page_copy_desc& d, PageCopyParams* p, int64_t* grid_blocks,
                        char* err, size_t err_len) {
  int inline_used = 0;
  if (int rc = FillSide("src", d.src, d, p, &inline_used, &p->src, err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (int rc = FillSide("dst", d.dst, d, p, &inline_used, &p->dst, err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  p->src_pages = d.src_pages;
  p->dst_pages = d.dst_pages;
  p->n_pages = d.n_pages;
  p->n_layers = d.n_layers;
  p->n_kv = d.n_kv;
  p->rows = d.rows;
  p->row_bytes = d.row_bytes;
  // A chunk gets about one 16-byte access per thread and unrolled step: a warp for up to
  // 2 KiB, the whole block from 16 KiB.
  const int64_t chunk_bytes = d.rows * d.row_bytes;
  const int64_t per_group_step = 16 * kUnroll;
  int threads = 32;
  while (threads < kThreadsPerBlock && threads * per_group_step < chunk_bytes) threads *= 2;
  p->chunks_per_block = kThreadsPerBlock / threads;
  const int64_t chunks = d.n_pages * d.n_layers * d.n_kv;
  *grid_blocks = std::min(kMaxGridBlocks, (chunks + p->chunks_per_block - 1) / p->chunks_per_block);
  return KVB_KERNEL_OK;
}

}  // namespace kvb_kernels::cuda
