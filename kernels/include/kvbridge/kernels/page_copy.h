/*
 * kvbridge page copy: gather/scatter of KV-cache pages between an engine's KV cache and the
 * host layouts kvbridge stores, on the CPU or on a CUDA GPU. No torch, no CUDA headers.
 *
 * Every SGLang and vLLM case is one primitive. For each entry i of two page-index arrays, each
 * layer and each K/V part ("kv"), copy `rows` rows of `row_bytes` bytes, where a side (source
 * or destination) addresses row r of page p as
 *
 *     plane(kv, layer) + p * page_stride_bytes + r * row_stride_bytes
 *
 * and plane(kv, layer) comes either from a table of per-layer base pointers (an engine's
 * per-layer device tensors) or from one buffer with strides (a host pool):
 *
 *     table mode: layer_ptrs[kv * table_kv_stride + layer] + kv * kv_stride_bytes
 *     base mode:  base + kv * kv_stride_bytes + layer * layer_stride_bytes
 *
 * Copies are byte-level and dtype-agnostic (row_bytes = heads * head_dim * dtype size). Page
 * indices are int64; a negative index on either side skips that entry: nothing is read or
 * written for it. Strides are int64 bytes, given at run time. The kvb_sglang_* and kvb_vllm_*
 * helpers below fill a side from the engines' own names, so most callers never compute a stride.
 *
 * SGLang token slots and page indices: SGLang hands out token *slots*; a page is page_size
 * consecutive slots starting at a multiple of page_size, so page index = slot / page_size,
 * taken from the first slot of each page (every page_size-th entry of a slot list). With
 * page_size 1 a page is one token and the index is the slot itself. kvb_sglang_slots_to_pages
 * converts a slot list and checks that it really is made of whole, aligned pages. Slot 0's
 * page in the device pool is SGLang's padding page: callers never name it, nothing here
 * treats it specially.
 *
 * Results: every function returns KVB_KERNEL_OK (0) or one of the KVB_KERNEL_ERR_* codes and,
 * on failure, writes a NUL-terminated message naming the offending field into err (when err
 * is non-NULL and err_len > 0; truncated to err_len). On failure nothing has been copied,
 * except where a comment says otherwise. err is not touched on success.
 *
 * Thread-safety: all functions are reentrant and keep no state between calls; concurrent calls
 * on disjoint destination bytes are safe. A desc is only read.
 *
 * This header is C99 and depends only on <stddef.h> and <stdint.h>.
 */
#ifndef KVBRIDGE_KERNELS_PAGE_COPY_H_
#define KVBRIDGE_KERNELS_PAGE_COPY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. Values never change once published. Bindings map them onto kvbridge's codes:
 * INVALID_ARGUMENT -> INVALID_ARGUMENT, INDEX_OUT_OF_RANGE -> OUT_OF_BOUNDS,
 * NOT_BUILT_WITH_CUDA and NO_CUDA_DEVICE -> UNAVAILABLE, CUDA and INTERNAL -> INTERNAL. */
enum {
  KVB_KERNEL_OK = 0,
  KVB_KERNEL_ERR_INVALID_ARGUMENT = 1,    /* a desc or helper argument is malformed */
  KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE = 2,  /* a page index >= that side's num_pages */
  KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA = 3, /* this build has no CUDA (KVBRIDGE_CUDA=OFF) */
  KVB_KERNEL_ERR_NO_CUDA_DEVICE = 4,      /* built with CUDA, but no usable device/driver */
  KVB_KERNEL_ERR_CUDA = 5,                /* the CUDA runtime failed (launch, memcpy, ...) */
  KVB_KERNEL_ERR_INTERNAL = 6             /* e.g. a worker thread could not be started */
};

/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for any other value. Never NULL. */
const char* kvb_kernel_status_name(int status);

/* One side of a copy. Zero-initialize, then set what the mode needs (or use a helper). */
typedef struct kvb_page_side {
  /* Base mode: the buffer every plane lies in. Ignored in table mode. */
  void* base;
  /* Table mode when either table is non-NULL. layer_ptrs is host-readable (needed by the CPU
   * path, and by the CUDA path unless layer_ptrs_device is set); layer_ptrs_device is an
   * optional GPU-readable copy of the same entries (see kvb_page_copy_cuda). */
  void* const* layer_ptrs;
  void* const* layer_ptrs_device;
  int64_t table_kv_stride;    /* table entries between K's and V's layer 0 (0: one table entry
                                 per layer, K and V inside it at kv_stride_bytes) */
  int64_t kv_stride_bytes;    /* bytes between the K and V planes (both modes) */
  int64_t layer_stride_bytes; /* bytes between layers (base mode only) */
  int64_t page_stride_bytes;  /* bytes between consecutive page indices */
  int64_t row_stride_bytes;   /* bytes between rows of one page; >= row_bytes */
  int64_t num_pages;          /* pages this side holds; an index >= it is an error on the CPU
                                 and is skipped on the GPU. 0: unknown, not checked */
} kvb_page_side;

/* One copy: for i in [0, n_pages), layer in [0, n_layers), kv in [0, n_kv), copy page
 * src_pages[i] of src to page dst_pages[i] of dst (skipped if either is negative).
 * REQUIRES: dst entries don't repeat and src/dst bytes don't overlap (else the result is
 * unspecified). */
typedef struct kvb_page_copy_desc {
  kvb_page_side src;
  kvb_page_side dst;
  const int64_t* src_pages; /* n_pages entries; GPU-readable for kvb_page_copy_cuda */
  const int64_t* dst_pages; /* n_pages entries; GPU-readable for kvb_page_copy_cuda */
  int64_t n_pages;          /* 0 is a valid no-op */
  int64_t n_layers;         /* >= 1 */
  int64_t n_kv;             /* 2 for MHA (K, V), 1 for MLA; any value >= 1 is accepted */
  int64_t rows;             /* rows per (page, layer, kv): page_size for token-major layouts */
  int64_t row_bytes;        /* bytes per row: heads * head_dim * dtype size for one token */
} kvb_page_copy_desc;

/* Checks a desc without reading any page index or table entry it points at (those may live
 * in GPU memory). Rules: non-NULL pointers where needed; n_layers, n_kv, rows, row_bytes >= 1;
 * n_pages >= 0; strides and num_pages >= 0; row_stride_bytes >= row_bytes on both sides; a
 * table that can tell K from V when n_kv > 1; and the destination must not overlap itself
 * (two (page, layer, kv, row) positions that would write the same bytes). */
int kvb_page_copy_validate(const kvb_page_copy_desc* desc, char* err, size_t err_len);

/* The CPU reference and host-memory path. Validates, checks every page index against
 * num_pages and every host table entry for NULL (nothing is copied if one fails), then copies
 * with num_threads threads, the calling thread among them, never more than n_pages (<= 0: the
 * hardware concurrency, but no more than one thread per 256 KiB copied). Threads take
 * contiguous ranges of entries; each (page, layer, kv) chunk is one memcpy when rows are
 * contiguous on both sides (row_stride_bytes == row_bytes), else one memcpy per row. All
 * pointers must be host-addressable. Returns when the copy is done. */
int kvb_page_copy_cpu(const kvb_page_copy_desc* desc, int num_threads, char* err, size_t err_len);

/* The CUDA path: validates the desc on the host, then enqueues one kernel on cuda_stream (a
 * cudaStream_t; NULL is the legacy default stream) and returns without waiting. Answers
 * KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA or KVB_KERNEL_ERR_NO_CUDA_DEVICE before looking at the
 * desc, so a call with a zeroed desc tells whether the GPU path can run at all.
 *
 * Every address the desc names (bases, table entries, page indices) must be readable (and the
 * destination writable) from the current device: device memory, pinned/registered host
 * memory, or managed memory. Pointer tables: with layer_ptrs_device set, the kernel reads that
 * table; otherwise the launcher copies the host table into the kernel's arguments, which
 * holds KVB_PAGE_COPY_CUDA_INLINE_PTRS entries for both sides together (a larger table needs
 * layer_ptrs_device). Arguments are captured at launch, so the call is CUDA-graph safe.
 * Page indices are not read on the host: a negative one skips; one >= num_pages (when
 * num_pages > 0) is skipped too rather than written out of bounds. Uses 16-byte loads and
 * stores wherever both addresses, strides and row_bytes allow, else 8, 4 or 1 bytes. */
#define KVB_PAGE_COPY_CUDA_INLINE_PTRS 448
int kvb_page_copy_cuda(const kvb_page_copy_desc* desc, void* cuda_stream, char* err,
                       size_t err_len);

/* ---- Filling sides from engine layouts ------------------------------------------------- */

/* What a helper derived besides the side; two sides of one copy must agree on it (see
 * kvb_page_copy_desc_init). */
typedef struct kvb_page_geometry {
  int64_t n_layers;
  int64_t n_kv;
  int64_t rows;
  int64_t row_bytes;
} kvb_page_geometry;

/* Fills desc from two sides whose geometries must be equal (else INVALID_ARGUMENT naming the
 * differing field), then runs kvb_page_copy_validate. */
int kvb_page_copy_desc_init(kvb_page_copy_desc* desc, const kvb_page_side* src,
                            const kvb_page_geometry* src_geometry, const kvb_page_side* dst,
                            const kvb_page_geometry* dst_geometry, const int64_t* src_pages,
                            const int64_t* dst_pages, int64_t n_pages, char* err, size_t err_len);

/* SGLang host pool layouts (MHATokenToKVPoolHost / MLATokenToKVPoolHost kv_buffer), with
 * S = total slots, L = layers, P = page_size, R = row_bytes = H * D * itemsize (MLA: one
 * row of kv_cache_dim * itemsize); MLA drops the leading 2:
 *   LAYER_FIRST        (2, L, S, H, D): one page of one layer is P contiguous rows;
 *   PAGE_FIRST         (2, S, L, H, D): token-major, rows of one layer are L * R apart;
 *   PAGE_FIRST_DIRECT  (2, S / P, L, P, H, D): one page of one layer is P contiguous rows. */
typedef enum kvb_sglang_layout {
  KVB_SGLANG_LAYER_FIRST = 0,
  KVB_SGLANG_PAGE_FIRST = 1,
  KVB_SGLANG_PAGE_FIRST_DIRECT = 2
} kvb_sglang_layout;

/* "layer_first", "page_first", "page_first_direct"; "unknown" otherwise. */
const char* kvb_sglang_layout_name(kvb_sglang_layout layout);

/* A side for a SGLang host pool. n_kv: 2 (MHA) or 1 (MLA). REQUIRES: total_slots is a
 * multiple of page_size. Page indices on this side are host slot / page_size. */
int kvb_sglang_host_side(kvb_page_side* side, kvb_page_geometry* geometry, kvb_sglang_layout layout,
                         void* base, int64_t n_layers, int64_t n_kv, int64_t total_slots,
                         int64_t page_size, int64_t row_bytes, char* err, size_t err_len);

/* A side for SGLang's device pool: one (slots, H, D) tensor per layer and K/V part, contiguous.
 * layer_ptrs holds n_kv * n_layers entries in SGLang's order, all K layers then all V layers
 * (get_contiguous_buf_infos' ptrs; MLA: the kv_buffer layers). layer_ptrs_device: an optional
 * GPU-readable copy (SGLang's data_ptrs tensor). total_slots: the per-layer tensor's first
 * dimension (size + page_size), or 0 if unknown. Page indices are device slot / page_size. */
int kvb_sglang_device_side(kvb_page_side* side, kvb_page_geometry* geometry,
                           void* const* layer_ptrs, void* const* layer_ptrs_device,
                           int64_t n_layers, int64_t n_kv, int64_t total_slots, int64_t page_size,
                           int64_t row_bytes, char* err, size_t err_len);

/* Converts n_slots SGLang token slots (whole pages: n_slots % page_size == 0; each page's
 * slots consecutive and its first slot a multiple of page_size) into n_slots / page_size page
 * indices. A page whose slots are all negative becomes -1 (skipped); a mix is an error. */
int kvb_sglang_slots_to_pages(const int64_t* slots, int64_t n_slots, int64_t page_size,
                              int64_t* pages, char* err, size_t err_len);

/* Narrows a side to one layer (SGLang's per-layer load): afterwards layer 0 of the side is
 * the given layer, so use it with n_layers = 1. Works in both modes. */
int kvb_page_side_select_layer(kvb_page_side* side, int64_t layer, int64_t n_layers, char* err,
                               size_t err_len);

/* A vLLM KV-cache tensor of any layout given by shape and strides at run time. */
#define KVB_MAX_DIMS 8
#define KVB_KV_DIM_NONE (-1)        /* no K/V parts: MLA, n_kv = 1 */
#define KVB_KV_DIM_PACKED_LAST (-2) /* K and V are the two halves of the last dimension */
#define KVB_LAYER_DIM_NONE (-1)     /* one tensor per layer (a pointer table) */
typedef struct kvb_vllm_kv_tensor {
  int ndim;                      /* 1..KVB_MAX_DIMS */
  int64_t shape[KVB_MAX_DIMS];   /* logical sizes */
  int64_t strides[KVB_MAX_DIMS]; /* in elements, >= 0 */
  int64_t elem_bytes;            /* dtype size: 1 fp8, 2 bf16/fp16, 4 fp32 */
  int block_dim;                 /* the num_blocks dimension (the page index) */
  int kv_dim;                    /* the size-2 K/V dimension, or KVB_KV_DIM_* */
  int layer_dim;                 /* a num_layers dimension (cross-layer tensors) or NONE */
} kvb_vllm_kv_tensor;

/* A side for vLLM block tensors, e.g. FlashAttention (2, blocks, block_size, H, D), FlashInfer
 * (blocks, 2, block_size, H, D), their HND stride orders, packed K|V (blocks, H, block_size,
 * 2 * D) with KVB_KV_DIM_PACKED_LAST, MLA (blocks, block_size, C) with KVB_KV_DIM_NONE, or one
 * cross-layer tensor (blocks, L, 2, block_size, H, D) with layer_dim set. The elements of one
 * (block, layer, kv) — every dimension but those three — are copied in memory order, as rows:
 * they must form `rows` runs of row_bytes contiguous bytes at one stride (true of all the
 * layouts above, padded head dims included); anything else is INVALID_ARGUMENT.
 * Per-layer tensors (layer_dim NONE): layer_ptrs / layer_ptrs_device hold n_layers data
 * pointers; base is ignored. Cross-layer: base is the data pointer, the tables must be NULL
 * and n_layers is ignored. Page indices on this side are vLLM block ids. */
int kvb_vllm_block_side(kvb_page_side* side, kvb_page_geometry* geometry,
                        const kvb_vllm_kv_tensor* tensor, void* base, void* const* layer_ptrs,
                        void* const* layer_ptrs_device, int64_t n_layers, char* err,
                        size_t err_len);

/* A contiguous page buffer: page p holds, in order, for each layer, for each kv part, `rows`
 * rows of row_bytes — [num_pages][n_layers][n_kv][rows][row_bytes], no padding. Pairs with any
 * side above to pack pages into (or unpack from) one flat buffer, e.g. vLLM blocks for a
 * connector. num_pages: the buffer's capacity in pages (0: unknown). */
int kvb_page_buffer_side(kvb_page_side* side, const kvb_page_geometry* geometry, void* base,
                         int64_t num_pages, char* err, size_t err_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVBRIDGE_KERNELS_PAGE_COPY_H_ */
