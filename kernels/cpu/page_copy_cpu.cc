// kvb_page_copy_cpu: the CPU reference. Threads take contiguous ranges of page entries; each
// (page, layer, kv) chunk is one memcpy when rows are contiguous on both sides, else one per row.
#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <exception>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "kernels/common/error.h"
#include "kvbridge/kernels/page_copy.h"

using kvb_kernels::Fail;

namespace {

// Below this many bytes per thread, an automatically sized copy uses fewer threads: starting
// a thread costs about as much as copying this much.
constexpr int64_t kAutoBytesPerThread = 256 << 10;

struct Side {
  std::vector<char*> planes;  // [kv * n_layers + layer]
  int64_t page_stride;
  int64_t row_stride;
};

Side Resolve(const kvb_page_side& s, const kvb_page_copy_desc& d) {
  Side out;
  out.page_stride = s.page_stride_bytes;
  out.row_stride = s.row_stride_bytes;
  out.planes.resize(static_cast<size_t>(d.n_kv * d.n_layers));
  for (int64_t kv = 0; kv < d.n_kv; ++kv) {
    for (int64_t layer = 0; layer < d.n_layers; ++layer) {
      char* p = s.layer_ptrs != nullptr
                    ? static_cast<char*>(s.layer_ptrs[kv * s.table_kv_stride + layer])
                    : static_cast<char*>(s.base) + layer * s.layer_stride_bytes;
      out.planes[kv * d.n_layers + layer] = p + kv * s.kv_stride_bytes;
    }
  }
  return out;
}

int CheckHostSide(const char* name, const kvb_page_side& s, const int64_t* pages,
                  const kvb_page_copy_desc& d, char* err, size_t err_len) {
  if (s.layer_ptrs == nullptr && s.layer_ptrs_device != nullptr) {
    return Fail(err, err_len, KVB_KERNEL_ERR_INVALID_ARGUMENT,
                "%s has only layer_ptrs_device; the CPU path needs the host-readable "
                "layer_ptrs",
                name);
  }
  if (s.layer_ptrs != nullptr) {
    for (int64_t kv = 0; kv < d.n_kv; ++kv) {
      for (int64_t layer = 0; layer < d.n_layers; ++layer) {
        const int64_t e = kv * s.table_kv_stride + layer;
        if (s.layer_ptrs[e] == nullptr) {
          return Fail(err, err_len, KVB_KERNEL_ERR_INVALID_ARGUMENT,
                      "%s.layer_ptrs[%" PRId64 "] (kv %" PRId64 ", layer %" PRId64 ") is NULL",
                      name, e, kv, layer);
        }
      }
    }
  }
  if (s.num_pages > 0) {
    for (int64_t i = 0; i < d.n_pages; ++i) {
      if (pages[i] >= s.num_pages) {
        return Fail(err, err_len, KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE,
                    "%s_pages[%" PRId64 "] = %" PRId64 " but %s.num_pages is %" PRId64, name, i,
                    pages[i], name, s.num_pages);
      }
    }
  }
  return KVB_KERNEL_OK;
}

void CopyRange(const kvb_page_copy_desc& d, const Side& src, const Side& dst, int64_t begin,
               int64_t end) {
  const int64_t planes = d.n_kv * d.n_layers;
  const int64_t rb = d.row_bytes;
  const bool contiguous = src.row_stride == rb && dst.row_stride == rb;
  const size_t chunk = static_cast<size_t>(d.rows * rb);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t sp = d.src_pages[i], dp = d.dst_pages[i];
    if (sp < 0 || dp < 0) continue;
    for (int64_t k = 0; k < planes; ++k) {
      const char* s = src.planes[k] + sp * src.page_stride;
      char* t = dst.planes[k] + dp * dst.page_stride;
      if (contiguous) {
        std::memcpy(t, s, chunk);
        continue;
      }
      for (int64_t r = 0; r < d.rows; ++r) {
        std::memcpy(t + r * dst.row_stride, s + r * src.row_stride, static_cast<size_t>(rb));
      }
    }
  }
}

}  // namespace

extern "C" int kvb_page_copy_cpu(const kvb_page_copy_desc* desc, int num_threads, char* err,
                                 size_t err_len) {
  if (int rc = kvb_page_copy_validate(desc, err, err_len); rc != KVB_KERNEL_OK) return rc;
  const kvb_page_copy_desc& d = *desc;
  if (int rc = CheckHostSide("src", d.src, d.src_pages, d, err, err_len); rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (int rc = CheckHostSide("dst", d.dst, d.dst_pages, d, err, err_len); rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (d.n_pages == 0) return KVB_KERNEL_OK;
  try {
    const Side src = Resolve(d.src, d);
    const Side dst = Resolve(d.dst, d);
    int64_t threads = num_threads;
    if (threads <= 0) {
      const double bytes = static_cast<double>(d.n_pages) * static_cast<double>(d.n_kv) *
                           static_cast<double>(d.n_layers) * static_cast<double>(d.rows) *
                           static_cast<double>(d.row_bytes);
      const double by_size = std::max(1.0, bytes / kAutoBytesPerThread);
      const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
      threads = by_size < static_cast<double>(hw) ? static_cast<int64_t>(by_size) : hw;
    }
    threads = std::min(threads, d.n_pages);
    auto range = [&](int64_t k) { return k * d.n_pages / threads; };
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(threads));  // so that only thread creation can throw
    int64_t next = 1;  // the first range not handed to a worker; range 0 is this thread's
    for (; next < threads; ++next) {
      try {
        workers.emplace_back(CopyRange, std::cref(d), std::cref(src), std::cref(dst), range(next),
                             range(next + 1));
      } catch (const std::system_error&) {
        break;  // out of threads: this thread copies what is left
      }
    }
    CopyRange(d, src, dst, range(0), range(1));
    if (next < threads) CopyRange(d, src, dst, range(next), d.n_pages);
    for (std::thread& w : workers) w.join();
  } catch (const std::exception& e) {
    return Fail(err, err_len, KVB_KERNEL_ERR_INTERNAL, "kvb_page_copy_cpu: %s", e.what());
  }
  return KVB_KERNEL_OK;
}
