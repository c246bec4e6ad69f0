// The helpers that fill a kvb_page_side from SGLang's and vLLM's own layout names.
#include <algorithm>
#include <cinttypes>
#include <initializer_list>
#include <vector>

#include "kernels/common/error.h"
#include "kvbridge/kernels/page_copy.h"

using kvb_kernels::Fail;

namespace {

constexpr int kInvalid = KVB_KERNEL_ERR_INVALID_ARGUMENT;

// Product of all values, false when it overflows int64.
bool Product(std::initializer_list<int64_t> values, int64_t* out) {
  int64_t p = 1;
  for (int64_t v : values) {
    if (__builtin_mul_overflow(p, v, &p)) return false;
  }
  *out = p;
  return true;
}

int CheckPositive(const char* fn, std::initializer_list<std::pair<const char*, int64_t>> args,
                  char* err, size_t err_len) {
  for (const auto& [name, value] : args) {
    if (value < 1) {
      return Fail(err, err_len, kInvalid, "%s: %s is %" PRId64 "; it must be >= 1", fn, name,
                  value);
    }
  }
  return KVB_KERNEL_OK;
}

int CheckKvParts(const char* fn, int64_t n_kv, char* err, size_t err_len) {
  if (n_kv != 1 && n_kv != 2) {
    return Fail(err, err_len, kInvalid, "%s: n_kv is %" PRId64 "; it must be 2 (MHA) or 1 (MLA)",
                fn, n_kv);
  }
  return KVB_KERNEL_OK;
}

}  // namespace

extern "C" {

const char* kvb_sglang_layout_name(kvb_sglang_layout layout) {
  switch (layout) {
    case KVB_SGLANG_LAYER_FIRST:
      return "layer_first";
    case KVB_SGLANG_PAGE_FIRST:
      return "page_first";
    case KVB_SGLANG_PAGE_FIRST_DIRECT:
      return "page_first_direct";
  }
  return "unknown";
}

int kvb_sglang_host_side(kvb_page_side* side, kvb_page_geometry* geometry, kvb_sglang_layout layout,
                         void* base, int64_t n_layers, int64_t n_kv, int64_t total_slots,
                         int64_t page_size, int64_t row_bytes, char* err, size_t err_len) {
  const char* fn = "kvb_sglang_host_side";
  if (side == nullptr || geometry == nullptr || base == nullptr) {
    return Fail(err, err_len, kInvalid, "%s: %s is NULL", fn,
                side == nullptr       ? "side"
                : geometry == nullptr ? "geometry"
                                      : "base");
  }
  if (int rc = CheckPositive(fn,
                             {{"n_layers", n_layers},
                              {"total_slots", total_slots},
                              {"page_size", page_size},
                              {"row_bytes", row_bytes}},
                             err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (int rc = CheckKvParts(fn, n_kv, err, err_len); rc != KVB_KERNEL_OK) return rc;
  if (total_slots % page_size != 0) {
    return Fail(err, err_len, kInvalid,
                "%s: total_slots (%" PRId64 ") is not a multiple of page_size (%" PRId64 ")", fn,
                total_slots, page_size);
  }
  int64_t plane = 0, total = 0, page = 0;  // one K (or V) plane; the pool; one page, one layer
  if (!Product({total_slots, n_layers, row_bytes}, &plane) || !Product({plane, n_kv}, &total) ||
      !Product({page_size, row_bytes}, &page)) {
    return Fail(err, err_len, kInvalid, "%s: the pool's size overflows 64 bits", fn);
  }
  kvb_page_side s = {};
  s.base = base;
  s.kv_stride_bytes = plane;
  s.num_pages = total_slots / page_size;
  switch (layout) {
    case KVB_SGLANG_LAYER_FIRST:  // (kv, L, S, H, D)
      s.layer_stride_bytes = total_slots * row_bytes;
      s.page_stride_bytes = page;
      s.row_stride_bytes = row_bytes;
      break;
    case KVB_SGLANG_PAGE_FIRST:  // (kv, S, L, H, D)
      s.layer_stride_bytes = row_bytes;
      s.page_stride_bytes = page * n_layers;
      s.row_stride_bytes = n_layers * row_bytes;
      break;
    case KVB_SGLANG_PAGE_FIRST_DIRECT:  // (kv, S / P, L, P, H, D)
      s.layer_stride_bytes = page;
      s.page_stride_bytes = page * n_layers;
      s.row_stride_bytes = row_bytes;
      break;
    default:
      return Fail(err, err_len, kInvalid, "%s: unknown layout %d", fn, static_cast<int>(layout));
  }
  *side = s;
  *geometry = {n_layers, n_kv, page_size, row_bytes};
  return KVB_KERNEL_OK;
}

int kvb_sglang_device_side(kvb_page_side* side, kvb_page_geometry* geometry,
                           void* const* layer_ptrs, void* const* layer_ptrs_device,
                           int64_t n_layers, int64_t n_kv, int64_t total_slots, int64_t page_size,
                           int64_t row_bytes, char* err, size_t err_len) {
  const char* fn = "kvb_sglang_device_side";
  if (side == nullptr || geometry == nullptr) {
    return Fail(err, err_len, kInvalid, "%s: %s is NULL", fn,
                side == nullptr ? "side" : "geometry");
  }
  if (layer_ptrs == nullptr && layer_ptrs_device == nullptr) {
    return Fail(err, err_len, kInvalid,
                "%s: layer_ptrs and layer_ptrs_device are both NULL; the device pool is "
                "addressed through its per-layer pointers",
                fn);
  }
  if (int rc = CheckPositive(
          fn, {{"n_layers", n_layers}, {"page_size", page_size}, {"row_bytes", row_bytes}}, err,
          err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (int rc = CheckKvParts(fn, n_kv, err, err_len); rc != KVB_KERNEL_OK) return rc;
  if (total_slots < 0) {
    return Fail(err, err_len, kInvalid, "%s: total_slots is %" PRId64 "; it must be >= 0", fn,
                total_slots);
  }
  int64_t page = 0;
  if (!Product({page_size, row_bytes}, &page)) {
    return Fail(err, err_len, kInvalid, "%s: page_size x row_bytes overflows 64 bits", fn);
  }
  kvb_page_side s = {};
  s.layer_ptrs = layer_ptrs;
  s.layer_ptrs_device = layer_ptrs_device;
  s.table_kv_stride = n_kv > 1 ? n_layers : 0;
  s.page_stride_bytes = page;
  s.row_stride_bytes = row_bytes;
  s.num_pages = total_slots / page_size;
  *side = s;
  *geometry = {n_layers, n_kv, page_size, row_bytes};
  return KVB_KERNEL_OK;
}

int kvb_sglang_slots_to_pages(const int64_t* slots, int64_t n_slots, int64_t page_size,
                              int64_t* pages, char* err, size_t err_len) {
  const char* fn = "kvb_sglang_slots_to_pages";
  if (page_size < 1) {
    return Fail(err, err_len, kInvalid, "%s: page_size is %" PRId64 "; it must be >= 1", fn,
                page_size);
  }
  if (n_slots < 0 || n_slots % page_size != 0) {
    return Fail(err, err_len, kInvalid,
                "%s: n_slots (%" PRId64 ") is not a whole number of pages of %" PRId64, fn, n_slots,
                page_size);
  }
  if (n_slots > 0 && (slots == nullptr || pages == nullptr)) {
    return Fail(err, err_len, kInvalid, "%s: %s is NULL", fn, slots == nullptr ? "slots" : "pages");
  }
  const int64_t n_pages = n_slots / page_size;
  // Check everything first so that a failure leaves pages untouched.
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t* run = slots + p * page_size;
    const bool skipped = run[0] < 0;
    if (!skipped && run[0] % page_size != 0) {
      return Fail(err, err_len, kInvalid,
                  "%s: slots[%" PRId64 "] = %" PRId64
                  " starts a page but is not a multiple of page_size %" PRId64,
                  fn, p * page_size, run[0], page_size);
    }
    for (int64_t j = 1; j < page_size; ++j) {
      const bool ok = skipped ? run[j] < 0 : run[j] == run[0] + j;
      if (!ok) {
        return Fail(err, err_len, kInvalid,
                    "%s: slots[%" PRId64 "] = %" PRId64
                    " breaks the page starting at slots[%" PRId64 "] = %" PRId64 " (%s)",
                    fn, p * page_size + j, run[j], p * page_size, run[0],
                    skipped ? "a skipped page must be all negative" : "expected consecutive slots");
      }
    }
  }
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t first = slots[p * page_size];
    pages[p] = first < 0 ? -1 : first / page_size;
  }
  return KVB_KERNEL_OK;
}

int kvb_page_side_select_layer(kvb_page_side* side, int64_t layer, int64_t n_layers, char* err,
                               size_t err_len) {
  const char* fn = "kvb_page_side_select_layer";
  if (side == nullptr) return Fail(err, err_len, kInvalid, "%s: side is NULL", fn);
  if (layer < 0 || layer >= n_layers) {
    return Fail(err, err_len, kInvalid, "%s: layer %" PRId64 " is outside [0, %" PRId64 ")", fn,
                layer, n_layers);
  }
  if (side->layer_ptrs != nullptr || side->layer_ptrs_device != nullptr) {
    if (side->layer_ptrs != nullptr) side->layer_ptrs += layer;
    if (side->layer_ptrs_device != nullptr) side->layer_ptrs_device += layer;
  } else {
    if (side->base == nullptr) return Fail(err, err_len, kInvalid, "%s: side->base is NULL", fn);
    side->base = static_cast<char*>(side->base) + layer * side->layer_stride_bytes;
  }
  return KVB_KERNEL_OK;
}

int kvb_vllm_block_side(kvb_page_side* side, kvb_page_geometry* geometry,
                        const kvb_vllm_kv_tensor* tensor, void* base, void* const* layer_ptrs,
                        void* const* layer_ptrs_device, int64_t n_layers, char* err,
                        size_t err_len) {
  const char* fn = "kvb_vllm_block_side";
  if (side == nullptr || geometry == nullptr || tensor == nullptr) {
    return Fail(err, err_len, kInvalid, "%s: %s is NULL", fn,
                side == nullptr       ? "side"
                : geometry == nullptr ? "geometry"
                                      : "tensor");
  }
  const kvb_vllm_kv_tensor& t = *tensor;
  if (t.ndim < 1 || t.ndim > KVB_MAX_DIMS) {
    return Fail(err, err_len, kInvalid, "%s: ndim is %d; it must be in [1, %d]", fn, t.ndim,
                KVB_MAX_DIMS);
  }
  if (t.elem_bytes < 1) {
    return Fail(err, err_len, kInvalid, "%s: elem_bytes is %" PRId64 "; it must be >= 1", fn,
                t.elem_bytes);
  }
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 1 || t.strides[i] < 0) {
      return Fail(err, err_len, kInvalid,
                  "%s: dimension %d has shape %" PRId64 " and stride %" PRId64
                  "; shapes must be >= 1 and strides >= 0",
                  fn, i, t.shape[i], t.strides[i]);
    }
  }
  const bool packed = t.kv_dim == KVB_KV_DIM_PACKED_LAST;
  if (t.block_dim < 0 || t.block_dim >= t.ndim) {
    return Fail(err, err_len, kInvalid, "%s: block_dim %d is not a dimension of a %d-d tensor", fn,
                t.block_dim, t.ndim);
  }
  if (!(t.kv_dim == KVB_KV_DIM_NONE || packed || (t.kv_dim >= 0 && t.kv_dim < t.ndim))) {
    return Fail(err, err_len, kInvalid,
                "%s: kv_dim %d is neither a dimension nor KVB_KV_DIM_NONE / "
                "KVB_KV_DIM_PACKED_LAST",
                fn, t.kv_dim);
  }
  if (!(t.layer_dim == KVB_LAYER_DIM_NONE || (t.layer_dim >= 0 && t.layer_dim < t.ndim))) {
    return Fail(err, err_len, kInvalid, "%s: layer_dim %d is not a dimension", fn, t.layer_dim);
  }
  if (t.kv_dim == t.block_dim || t.layer_dim == t.block_dim ||
      (t.kv_dim >= 0 && t.kv_dim == t.layer_dim)) {
    return Fail(err, err_len, kInvalid,
                "%s: block_dim (%d), kv_dim (%d) and layer_dim (%d) must be different", fn,
                t.block_dim, t.kv_dim, t.layer_dim);
  }
  const int last = t.ndim - 1;
  if (packed && (last == t.block_dim || last == t.layer_dim || t.shape[last] % 2 != 0)) {
    return Fail(err, err_len, kInvalid,
                "%s: KVB_KV_DIM_PACKED_LAST needs an even last dimension that is neither the "
                "block nor the layer dimension (it has %" PRId64 " elements)",
                fn, t.shape[last]);
  }

  const int64_t eb = t.elem_bytes;
  kvb_page_side s = {};
  int64_t n_kv = 1;
  if (t.kv_dim >= 0) {
    n_kv = t.shape[t.kv_dim];
    s.kv_stride_bytes = t.strides[t.kv_dim] * eb;
  } else if (packed) {
    n_kv = 2;
    s.kv_stride_bytes = t.shape[last] / 2 * t.strides[last] * eb;
  }
  if (t.layer_dim >= 0) {
    if (base == nullptr || layer_ptrs != nullptr || layer_ptrs_device != nullptr) {
      return Fail(err, err_len, kInvalid,
                  "%s: a cross-layer tensor (layer_dim %d) needs base and no layer tables", fn,
                  t.layer_dim);
    }
    s.base = base;
    n_layers = t.shape[t.layer_dim];
    s.layer_stride_bytes = t.strides[t.layer_dim] * eb;
  } else {
    if (layer_ptrs == nullptr && layer_ptrs_device == nullptr) {
      return Fail(err, err_len, kInvalid,
                  "%s: per-layer tensors (layer_dim NONE) need layer_ptrs or layer_ptrs_device",
                  fn);
    }
    if (n_layers < 1) {
      return Fail(err, err_len, kInvalid, "%s: n_layers is %" PRId64 "; it must be >= 1", fn,
                  n_layers);
    }
    s.layer_ptrs = layer_ptrs;
    s.layer_ptrs_device = layer_ptrs_device;
  }
  s.page_stride_bytes = t.strides[t.block_dim] * eb;
  s.num_pages = t.shape[t.block_dim];

  // The elements of one (block, layer, kv), outermost first: a contiguous run of row_bytes
  // innermost, then at most one more dimension (the rows) after merging nested ones.
  struct Dim {
    int index;
    int64_t size, stride;  // stride in bytes
  };
  std::vector<Dim> dims;
  for (int i = 0; i < t.ndim; ++i) {
    if (i == t.block_dim || i == t.kv_dim || i == t.layer_dim) continue;
    const int64_t size = (packed && i == last) ? t.shape[i] / 2 : t.shape[i];
    if (size > 1) dims.push_back({i, size, t.strides[i] * eb});
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.stride > b.stride; });
  int64_t row_bytes = eb;
  while (!dims.empty() && dims.back().stride == row_bytes) {
    if (!Product({row_bytes, dims.back().size}, &row_bytes)) {
      return Fail(err, err_len, kInvalid, "%s: a block's size overflows 64 bits", fn);
    }
    dims.pop_back();
  }
  int64_t rows = 1, row_stride = row_bytes;
  if (!dims.empty()) {
    Dim row = dims.back();
    dims.pop_back();
    if (row.stride < row_bytes) {
      return Fail(err, err_len, kInvalid,
                  "%s: dimension %d's stride (%" PRId64 " bytes) is inside the %" PRId64
                  " contiguous bytes below it: elements overlap",
                  fn, row.index, row.stride, row_bytes);
    }
    while (!dims.empty()) {
      const Dim outer = dims.back();
      if (outer.stride != row.stride * row.size) {
        return Fail(err, err_len, kInvalid,
                    "%s: a block's elements are not rows of one stride: dimension %d (stride "
                    "%" PRId64 " bytes) does not continue dimension %d (%" PRId64 " x %" PRId64
                    " bytes) over runs of %" PRId64 " bytes; copy such a tensor in parts",
                    fn, outer.index, outer.stride, row.index, row.size, row.stride, row_bytes);
      }
      row.size *= outer.size;
      dims.pop_back();
    }
    rows = row.size;
    row_stride = row.stride;
  }
  s.row_stride_bytes = row_stride;
  *side = s;
  *geometry = {n_layers, n_kv, rows, row_bytes};
  return KVB_KERNEL_OK;
}

int kvb_page_buffer_side(kvb_page_side* side, const kvb_page_geometry* geometry, void* base,
                         int64_t num_pages, char* err, size_t err_len) {
  const char* fn = "kvb_page_buffer_side";
  if (side == nullptr || geometry == nullptr || base == nullptr) {
    return Fail(err, err_len, kInvalid, "%s: %s is NULL", fn,
                side == nullptr       ? "side"
                : geometry == nullptr ? "geometry"
                                      : "base");
  }
  const kvb_page_geometry& g = *geometry;
  if (int rc = CheckPositive(fn,
                             {{"geometry->n_layers", g.n_layers},
                              {"geometry->n_kv", g.n_kv},
                              {"geometry->rows", g.rows},
                              {"geometry->row_bytes", g.row_bytes}},
                             err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (num_pages < 0) {
    return Fail(err, err_len, kInvalid, "%s: num_pages is %" PRId64 "; it must be >= 0", fn,
                num_pages);
  }
  int64_t part = 0, page = 0;
  if (!Product({g.rows, g.row_bytes}, &part) || !Product({part, g.n_kv, g.n_layers}, &page)) {
    return Fail(err, err_len, kInvalid, "%s: one page's size overflows 64 bits", fn);
  }
  kvb_page_side s = {};
  s.base = base;
  s.row_stride_bytes = g.row_bytes;
  s.kv_stride_bytes = part;
  s.layer_stride_bytes = part * g.n_kv;
  s.page_stride_bytes = page;
  s.num_pages = num_pages;
  *side = s;
  return KVB_KERNEL_OK;
}

}  // extern "C"
