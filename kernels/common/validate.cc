// kvb_page_copy_validate and the small lookups shared by the CPU and CUDA paths.
#include <algorithm>
#include <cinttypes>
#include <string>
#include <vector>

#include "kernels/common/error.h"
#include "kvbridge/kernels/page_copy.h"

using kvb_kernels::Fail;

namespace {

constexpr int kInvalid = KVB_KERNEL_ERR_INVALID_ARGUMENT;

bool TableMode(const kvb_page_side& s) {
  return s.layer_ptrs != nullptr || s.layer_ptrs_device != nullptr;
}

// One dimension of a side's address space, for the self-overlap check.
struct Dim {
  const char* what;   // "rows", "pages", ...
  const char* field;  // the stride's field name
  int64_t count;      // 0: unknown (only pages can be)
  int64_t stride;
};

// The destination must not write one byte twice: sorted by stride, every dimension must step
// at least as far as everything inside it spans (the usual non-overlapping strided-tensor
// rule). A dimension of unknown count is checked against what is inside it; dimensions
// outside it cannot be bounded and are accepted.
int CheckNoSelfOverlap(const char* side, const kvb_page_side& s, const kvb_page_copy_desc& d,
                       char* err, size_t err_len) {
  std::vector<Dim> dims;
  dims.push_back({"rows", "row_stride_bytes", d.rows, s.row_stride_bytes});
  dims.push_back({"pages", "page_stride_bytes", s.num_pages, s.page_stride_bytes});
  if (!TableMode(s)) {
    dims.push_back({"layers", "layer_stride_bytes", d.n_layers, s.layer_stride_bytes});
    dims.push_back({"kv parts", "kv_stride_bytes", d.n_kv, s.kv_stride_bytes});
  } else if (s.table_kv_stride == 0) {
    dims.push_back({"kv parts", "kv_stride_bytes", d.n_kv, s.kv_stride_bytes});
  }
  dims.erase(std::remove_if(dims.begin(), dims.end(), [](const Dim& x) { return x.count == 1; }),
             dims.end());
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  __int128 span = d.row_bytes;
  std::string inside = "one row";
  std::string names;
  for (const Dim& dim : dims) {
    if (dim.stride < span) {
      return Fail(err, err_len, kInvalid,
                  "%s overlaps itself: %s.%s is %" PRId64 " bytes, less than the %" PRId64
                  " bytes spanned by %s, so two %s would write the same bytes",
                  side, side, dim.field, dim.stride,
                  static_cast<int64_t>(std::min<__int128>(span, INT64_MAX)), inside.c_str(),
                  dim.what);
    }
    if (dim.count == 0) break;
    span += static_cast<__int128>(dim.stride) * (dim.count - 1);
    names = names.empty() ? dim.what : std::string(dim.what) + " and " + names;
    inside = "the " + names + " inside it";
  }
  return KVB_KERNEL_OK;
}

int ValidateSide(const char* side, const kvb_page_side& s, const kvb_page_copy_desc& d, bool is_dst,
                 char* err, size_t err_len) {
  if (!TableMode(s) && s.base == nullptr) {
    return Fail(err, err_len, kInvalid,
                "%s.base is NULL and %s has no layer_ptrs table: set one of them", side, side);
  }
  struct {
    const char* field;
    int64_t value;
  } const non_negative[] = {
      {"table_kv_stride", s.table_kv_stride},       {"kv_stride_bytes", s.kv_stride_bytes},
      {"layer_stride_bytes", s.layer_stride_bytes}, {"page_stride_bytes", s.page_stride_bytes},
      {"row_stride_bytes", s.row_stride_bytes},     {"num_pages", s.num_pages}};
  for (const auto& f : non_negative) {
    if (f.value < 0) {
      return Fail(err, err_len, kInvalid, "%s.%s is %" PRId64 "; it must be >= 0", side, f.field,
                  f.value);
    }
  }
  if (s.row_stride_bytes < d.row_bytes) {
    return Fail(err, err_len, kInvalid,
                "%s.row_stride_bytes (%" PRId64 ") is smaller than row_bytes (%" PRId64
                "): consecutive rows would overlap",
                side, s.row_stride_bytes, d.row_bytes);
  }
  if (s.page_stride_bytes == 0 && d.n_pages > 1 && s.num_pages != 1) {
    return Fail(err, err_len, kInvalid,
                "%s.page_stride_bytes is 0: every page index would address the same bytes", side);
  }
  if (TableMode(s)) {
    if (d.n_kv > 1 && s.table_kv_stride == 0 && s.kv_stride_bytes == 0) {
      return Fail(err, err_len, kInvalid,
                  "%s has a layer table and n_kv = %" PRId64
                  " but neither table_kv_stride (separate K and V tables) nor kv_stride_bytes "
                  "(K and V inside each layer's tensor) is set",
                  side, d.n_kv);
    }
    if (d.n_kv > 1 && s.table_kv_stride != 0 && s.table_kv_stride < d.n_layers) {
      return Fail(err, err_len, kInvalid,
                  "%s.table_kv_stride (%" PRId64 ") is smaller than n_layers (%" PRId64
                  "): the K and V tables would share entries",
                  side, s.table_kv_stride, d.n_layers);
    }
  } else {
    if (d.n_layers > 1 && s.layer_stride_bytes == 0) {
      return Fail(err, err_len, kInvalid,
                  "%s.layer_stride_bytes is 0 with n_layers = %" PRId64
                  ": every layer would address the same bytes",
                  side, d.n_layers);
    }
    if (d.n_kv > 1 && s.kv_stride_bytes == 0) {
      return Fail(err, err_len, kInvalid,
                  "%s.kv_stride_bytes is 0 with n_kv = %" PRId64
                  ": K and V would address the same bytes",
                  side, d.n_kv);
    }
  }
  if (is_dst) return CheckNoSelfOverlap(side, s, d, err, err_len);
  return KVB_KERNEL_OK;
}

}  // namespace

extern "C" {

const char* kvb_kernel_status_name(int status) {
  switch (status) {
    case KVB_KERNEL_OK:
      return "OK";
    case KVB_KERNEL_ERR_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE:
      return "INDEX_OUT_OF_RANGE";
    case KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA:
      return "NOT_BUILT_WITH_CUDA";
    case KVB_KERNEL_ERR_NO_CUDA_DEVICE:
      return "NO_CUDA_DEVICE";
    case KVB_KERNEL_ERR_CUDA:
      return "CUDA";
    case KVB_KERNEL_ERR_INTERNAL:
      return "INTERNAL";
    default:
      return "UNKNOWN";
  }
}

int kvb_page_copy_validate(const kvb_page_copy_desc* desc, char* err, size_t err_len) {
  if (desc == nullptr) return Fail(err, err_len, kInvalid, "desc is NULL");
  const kvb_page_copy_desc& d = *desc;
  if (d.n_pages < 0) {
    return Fail(err, err_len, kInvalid, "n_pages is %" PRId64 "; it must be >= 0", d.n_pages);
  }
  if (d.n_pages > 0 && (d.src_pages == nullptr || d.dst_pages == nullptr)) {
    return Fail(err, err_len, kInvalid, "%s is NULL with n_pages = %" PRId64,
                d.src_pages == nullptr ? "src_pages" : "dst_pages", d.n_pages);
  }
  struct {
    const char* field;
    int64_t value;
  } const positive[] = {
      {"n_layers", d.n_layers}, {"n_kv", d.n_kv}, {"rows", d.rows}, {"row_bytes", d.row_bytes}};
  for (const auto& f : positive) {
    if (f.value < 1) {
      return Fail(err, err_len, kInvalid, "%s is %" PRId64 "; it must be >= 1", f.field, f.value);
    }
  }
  int64_t chunk_bytes = 0;
  if (__builtin_mul_overflow(d.rows, d.row_bytes, &chunk_bytes)) {
    return Fail(err, err_len, kInvalid,
                "rows (%" PRId64 ") x row_bytes (%" PRId64 ") overflows 64 bits", d.rows,
                d.row_bytes);
  }
  if (int rc = ValidateSide("src", d.src, d, false, err, err_len); rc != KVB_KERNEL_OK) return rc;
  return ValidateSide("dst", d.dst, d, true, err, err_len);
}

int kvb_page_copy_desc_init(kvb_page_copy_desc* desc, const kvb_page_side* src,
                            const kvb_page_geometry* src_geometry, const kvb_page_side* dst,
                            const kvb_page_geometry* dst_geometry, const int64_t* src_pages,
                            const int64_t* dst_pages, int64_t n_pages, char* err, size_t err_len) {
  if (desc == nullptr || src == nullptr || dst == nullptr || src_geometry == nullptr ||
      dst_geometry == nullptr) {
    return Fail(err, err_len, kInvalid, "kvb_page_copy_desc_init: a pointer argument is NULL");
  }
  const kvb_page_geometry& a = *src_geometry;
  const kvb_page_geometry& b = *dst_geometry;
  struct {
    const char* field;
    int64_t src, dst;
  } const fields[] = {{"n_layers", a.n_layers, b.n_layers},
                      {"n_kv", a.n_kv, b.n_kv},
                      {"rows", a.rows, b.rows},
                      {"row_bytes", a.row_bytes, b.row_bytes}};
  for (const auto& f : fields) {
    if (f.src != f.dst) {
      return Fail(err, err_len, kInvalid,
                  "the sides disagree on %s: src has %" PRId64 ", dst has %" PRId64, f.field, f.src,
                  f.dst);
    }
  }
  kvb_page_copy_desc d = {};
  d.src = *src;
  d.dst = *dst;
  d.src_pages = src_pages;
  d.dst_pages = dst_pages;
  d.n_pages = n_pages;
  d.n_layers = a.n_layers;
  d.n_kv = a.n_kv;
  d.rows = a.rows;
  d.row_bytes = a.row_bytes;
  if (int rc = kvb_page_copy_validate(&d, err, err_len); rc != KVB_KERNEL_OK) return rc;
  *desc = d;
  return KVB_KERNEL_OK;
}

}  // extern "C"
