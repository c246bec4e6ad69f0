#include "tests/kernels/kernel_test_util.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>

#include "kernels/cuda/page_copy_kernel.cuh"
#include "kernels/cuda/page_copy_params.h"
#include "kvbridge/kernels/cuda_memory.h"

namespace kvb_test {
namespace {

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// n distinct values from [0, range), shuffled.
std::vector<int64_t> Distinct(int64_t n, int64_t range, std::mt19937_64& rng) {
  std::vector<int64_t> all(static_cast<size_t>(range));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

// Entry lists with one entry skipped through each side (when there are enough entries).
void PickPages(int64_t n, int64_t src_range, int64_t dst_range, uint64_t seed, Case* c) {
  std::mt19937_64 rng(seed);
  c->src_pages = Distinct(n, src_range, rng);
  c->dst_pages = Distinct(n, dst_range, rng);
  if (n >= 3) {
    c->src_pages[1] = -1;
    c->dst_pages[n - 1] = -7;
  }
}

}  // namespace

Region::Region(size_t payload_bytes, size_t misalign) : misalign_(misalign) {
  storage_bytes_ = kGuardBytes + misalign + payload_bytes + kGuardBytes;
  buffer_.resize(storage_bytes_ + 256);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer_.data());
  storage_ = buffer_.data() + ((256 - p % 256) % 256);
}

void Region::FillRandom(uint64_t seed) {
  uint64_t state = seed;
  for (size_t i = 0; i < storage_bytes_; i += 8) {
    const uint64_t v = SplitMix(&state);
    std::memcpy(storage_ + i, &v, std::min<size_t>(8, storage_bytes_ - i));
  }
}

void ApplyOracle(const Case& c, const uint8_t* src, uint8_t* dst) {
  for (size_t i = 0; i < c.src_pages.size(); ++i) {
    const int64_t sp = c.src_pages[i], dp = c.dst_pages[i];
    if (sp < 0 || dp < 0) continue;
    for (int64_t layer = 0; layer < c.n_layers; ++layer) {
      for (int64_t kv = 0; kv < c.n_kv; ++kv) {
        for (int64_t u = 0; u < c.chunk_bytes; ++u) {
          dst[c.dst_offset(kv, layer, dp, u)] = src[c.src_offset(kv, layer, sp, u)];
        }
      }
    }
  }
}

std::vector<SglangShape> SglangShapes() {
  return {
      {1, 3, 24},    // one token per page
      {17, 3, 129},  // odd page size, odd row bytes at fp8
      {16, 2, 64},   // aligned rows: the 16-byte path
      {4, 1, 8},     // tiny rows
  };
}

Case SglangCase(kvb_sglang_layout layout, bool backup, bool mla, int64_t elem_bytes,
                SglangShape shape, int64_t n_layers, uint64_t seed, int64_t only_layer) {
  const int64_t P = shape.page_size;
  const int64_t R = shape.heads * shape.head_dim * elem_bytes;
  const int64_t n_kv = mla ? 1 : 2;
  const int64_t dev_pages = 7, host_pages = 6;
  const int64_t S_dev = dev_pages * P, S_host = host_pages * P;
  // Every third seed keeps everything 16-byte aligned; the others shift bases by odd amounts.
  const bool aligned = seed % 3 == 0;
  const int64_t gap = aligned ? 48 : 40 - static_cast<int64_t>(seed % 7);
  const int64_t layer_bytes = S_dev * R + gap;
  const int64_t L = n_layers;

  Case c;
  c.name = std::string(kvb_sglang_layout_name(layout)) + (backup ? "/backup" : "/load") +
           (mla ? "/mla" : "/mha") + "/elem" + std::to_string(elem_bytes) + "/P" +
           std::to_string(P) + "_H" + std::to_string(shape.heads) + "_D" +
           std::to_string(shape.head_dim) +
           (only_layer >= 0 ? "/layer" + std::to_string(only_layer) : "");
  c.n_layers = only_layer >= 0 ? 1 : L;
  c.n_kv = n_kv;
  c.chunk_bytes = P * R;
  const size_t dev_bytes = static_cast<size_t>(n_kv * L * layer_bytes);
  const size_t host_bytes = static_cast<size_t>(n_kv * L * S_host * R);
  const size_t dev_misalign = aligned ? 0 : seed % 13;
  const size_t host_misalign = aligned ? 0 : (seed * 7) % 11;

  // Offsets written from the tensors' shapes, not from the helpers' strides.
  auto layer_of = [only_layer](int64_t layer) { return only_layer >= 0 ? only_layer : layer; };
  OffsetFn dev = [=](int64_t kv, int64_t layer, int64_t page, int64_t unit) {
    // per-layer tensor (S_dev, H, D); K tensors then V tensors, `gap` bytes apart
    return (kv * L + layer_of(layer)) * layer_bytes + (page * P) * R + unit;
  };
  OffsetFn host = [=](int64_t kv, int64_t layer, int64_t page, int64_t unit) -> int64_t {
    const int64_t l = layer_of(layer), j = unit / R, b = unit % R, slot = page * P + j;
    switch (layout) {
      case KVB_SGLANG_LAYER_FIRST:  // (kv, L, S, H, D)
        return ((kv * L + l) * S_host + slot) * R + b;
      case KVB_SGLANG_PAGE_FIRST:  // (kv, S, L, H, D)
        return ((kv * S_host + slot) * L + l) * R + b;
      case KVB_SGLANG_PAGE_FIRST_DIRECT:  // (kv, S / P, L, P, H, D)
        return (((kv * host_pages + page) * L + l) * P + j) * R + b;
    }
    return -1;
  };
  if (backup) {
    c.src_bytes = dev_bytes, c.dst_bytes = host_bytes;
    c.src_misalign = dev_misalign, c.dst_misalign = host_misalign;
    c.src_offset = dev, c.dst_offset = host;
    PickPages(5, dev_pages, host_pages, seed, &c);
  } else {
    c.src_bytes = host_bytes, c.dst_bytes = dev_bytes;
    c.src_misalign = host_misalign, c.dst_misalign = dev_misalign;
    c.src_offset = host, c.dst_offset = dev;
    PickPages(5, host_pages, dev_pages, seed, &c);
  }
  c.build = [=](uint8_t* src, uint8_t* dst, Built* out, char* err, size_t err_len) {
    uint8_t* dev_base = backup ? src : dst;
    uint8_t* host_base = backup ? dst : src;
    std::vector<void*>& table = backup ? out->src_table : out->dst_table;
    table.clear();
    for (int64_t kv = 0; kv < n_kv; ++kv) {
      for (int64_t layer = 0; layer < L; ++layer) {
        table.push_back(dev_base + (kv * L + layer) * layer_bytes);
      }
    }
    kvb_page_side dev_side, host_side;
    kvb_page_geometry dev_geom, host_geom;
    int rc = kvb_sglang_device_side(&dev_side, &dev_geom, table.data(), nullptr, L, n_kv, S_dev, P,
                                    R, err, err_len);
    if (rc == KVB_KERNEL_OK) {
      rc = kvb_sglang_host_side(&host_side, &host_geom, layout, host_base, L, n_kv, S_host, P, R,
                                err, err_len);
    }
    if (rc == KVB_KERNEL_OK && only_layer >= 0) {
      rc = kvb_page_side_select_layer(&dev_side, only_layer, L, err, err_len);
      if (rc == KVB_KERNEL_OK) {
        rc = kvb_page_side_select_layer(&host_side, only_layer, L, err, err_len);
      }
      dev_geom.n_layers = host_geom.n_layers = 1;
    }
    if (rc != KVB_KERNEL_OK) return rc;
    const auto n = static_cast<int64_t>(out->src_pages.size());
    return backup ? kvb_page_copy_desc_init(&out->desc, &dev_side, &dev_geom, &host_side,
                                            &host_geom, out->src_pages.data(),
                                            out->dst_pages.data(), n, err, err_len)
                  : kvb_page_copy_desc_init(&out->desc, &host_side, &host_geom, &dev_side,
                                            &dev_geom, out->src_pages.data(), out->dst_pages.data(),
                                            n, err, err_len);
  };
  return c;
}

std::vector<int64_t> StridesFor(const std::vector<int64_t>& shape,
                                const std::vector<int>& physical) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (auto it = physical.rbegin(); it != physical.rend(); ++it) {
    strides[static_cast<size_t>(*it)] = s;
    s *= shape[static_cast<size_t>(*it)];
  }
  return strides;
}

std::vector<VllmLayout> VllmLayouts() {
  const int64_t B = 6, bs = 16, H = 2, D = 24, L = 3;
  std::vector<VllmLayout> v;
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<int> physical, int block,
                 int kv, int layer) {
    std::vector<int64_t> strides = StridesFor(shape, physical);
    v.push_back({std::move(name), std::move(shape), std::move(strides), block, kv, layer});
  };
  add("flash_attn_nhd", {2, B, bs, H, D}, {0, 1, 2, 3, 4}, 1, 0, KVB_LAYER_DIM_NONE);
  add("flash_attn_hnd", {2, B, bs, H, D}, {0, 1, 3, 2, 4}, 1, 0, KVB_LAYER_DIM_NONE);
  add("flashinfer_nhd", {B, 2, bs, H, D}, {0, 1, 2, 3, 4}, 0, 1, KVB_LAYER_DIM_NONE);
  add("flashinfer_hnd", {B, 2, bs, H, D}, {0, 1, 3, 2, 4}, 0, 1, KVB_LAYER_DIM_NONE);
  add("packed_kv_hnd", {B, H, bs, 2 * D}, {0, 1, 2, 3}, 0, KVB_KV_DIM_PACKED_LAST,
      KVB_LAYER_DIM_NONE);
  add("mla", {B, 5, 72}, {0, 1, 2}, 0, KVB_KV_DIM_NONE, KVB_LAYER_DIM_NONE);
  add("odd_nhd", {B, 2, 5, 3, 129}, {0, 1, 2, 3, 4}, 0, 1, KVB_LAYER_DIM_NONE);
  add("cross_layer_nhd", {B, L, 2, bs, H, D}, {0, 1, 2, 3, 4, 5}, 0, 2, 1);
  add("lbhnc_packed", {L, B, H, bs, 2 * D}, {0, 1, 2, 3, 4}, 1, KVB_KV_DIM_PACKED_LAST, 0);
  add("blhnc_mla", {B, L, 1, bs, 40}, {0, 1, 2, 3, 4}, 0, KVB_KV_DIM_NONE, 1);
  // Head dim 24 stored 32 apart, and 40 spare elements after every block.
  v.push_back({"padded_heads_nhd",
               {B, 2, bs, H, D},
               {2 * bs * H * 32 + 40, bs * H * 32, H * 32, 32, 1},
               0,
               1,
               KVB_LAYER_DIM_NONE});
  return v;
}

Case VllmCase(const VllmLayout& t, int64_t es, bool save, uint64_t seed) {
  const int ndim = static_cast<int>(t.shape.size());
  const int last = ndim - 1;
  const bool packed = t.kv_dim == KVB_KV_DIM_PACKED_LAST;
  const bool cross = t.layer_dim >= 0;
  const int64_t L = cross ? t.shape[static_cast<size_t>(t.layer_dim)] : 3;
  const int64_t n_kv = t.kv_dim >= 0 ? t.shape[static_cast<size_t>(t.kv_dim)] : packed ? 2 : 1;
  int64_t span = 1;  // elements one tensor covers
  for (int d = 0; d < ndim; ++d) span += (t.shape[d] - 1) * t.strides[d];
  const int64_t gap = 32 + static_cast<int64_t>(seed % 9);
  const int64_t layer_bytes = span * es + gap;

  // Element offsets of one (block, layer, kv), in memory order.
  std::vector<int64_t> offsets = {0};
  for (int d = 0; d < ndim; ++d) {
    if (d == t.block_dim || d == t.kv_dim || d == t.layer_dim) continue;
    const int64_t size = (packed && d == last) ? t.shape[d] / 2 : t.shape[d];
    std::vector<int64_t> next;
    for (int64_t o : offsets) {
      for (int64_t i = 0; i < size; ++i) next.push_back(o + i * t.strides[d]);
    }
    offsets.swap(next);
  }
  std::sort(offsets.begin(), offsets.end());
  const auto E = static_cast<int64_t>(offsets.size());
  auto kv_offset = [=](int64_t kv) -> int64_t {
    if (t.kv_dim >= 0) return kv * t.strides[static_cast<size_t>(t.kv_dim)];
    if (packed)
      return kv * (t.shape[static_cast<size_t>(last)] / 2) * t.strides[static_cast<size_t>(last)];
    return 0;
  };
  auto layer_base = [=](int64_t layer) -> int64_t {  // bytes
    return cross ? layer * t.strides[static_cast<size_t>(t.layer_dim)] * es : layer * layer_bytes;
  };
  const int64_t blocks = t.shape[static_cast<size_t>(t.block_dim)];
  const int64_t block_stride = t.strides[static_cast<size_t>(t.block_dim)];
  const int64_t buf_pages = 5;

  Case c;
  c.name = "vllm/" + t.name + (save ? "/save" : "/load") + "/elem" + std::to_string(es);
  c.n_layers = L;
  c.n_kv = n_kv;
  c.chunk_bytes = E * es;
  OffsetFn dev = [=](int64_t kv, int64_t layer, int64_t page, int64_t unit) {
    return layer_base(layer) +
           (page * block_stride + kv_offset(kv) + offsets[static_cast<size_t>(unit / es)]) * es +
           unit % es;
  };
  OffsetFn buf = [=](int64_t kv, int64_t layer, int64_t page, int64_t unit) {
    return ((page * L + layer) * n_kv + kv) * E * es + unit;
  };
  const size_t dev_bytes = static_cast<size_t>(cross ? span * es : L * layer_bytes);
  const size_t buf_bytes = static_cast<size_t>(buf_pages * L * n_kv * E * es);
  const size_t dev_misalign = seed % 2 == 0 ? 0 : seed % 15;
  if (save) {
    c.src_bytes = dev_bytes, c.dst_bytes = buf_bytes;
    c.src_misalign = dev_misalign;
    c.src_offset = dev, c.dst_offset = buf;
    PickPages(4, blocks, buf_pages, seed, &c);
  } else {
    c.src_bytes = buf_bytes, c.dst_bytes = dev_bytes;
    c.dst_misalign = dev_misalign;
    c.src_offset = buf, c.dst_offset = dev;
    PickPages(4, buf_pages, blocks, seed, &c);
  }
  c.build = [=](uint8_t* src, uint8_t* dst, Built* out, char* err, size_t err_len) {
    uint8_t* dev_base = save ? src : dst;
    uint8_t* buf_base = save ? dst : src;
    kvb_vllm_kv_tensor tensor = {};
    tensor.ndim = ndim;
    for (int d = 0; d < ndim; ++d) {
      tensor.shape[d] = t.shape[static_cast<size_t>(d)];
      tensor.strides[d] = t.strides[static_cast<size_t>(d)];
    }
    tensor.elem_bytes = es;
    tensor.block_dim = t.block_dim;
    tensor.kv_dim = t.kv_dim;
    tensor.layer_dim = t.layer_dim;
    kvb_page_side dev_side, buf_side;
    kvb_page_geometry geom;
    int rc;
    if (cross) {
      rc = kvb_vllm_block_side(&dev_side, &geom, &tensor, dev_base, nullptr, nullptr, 0, err,
                               err_len);
    } else {
      std::vector<void*>& table = save ? out->src_table : out->dst_table;
      table.clear();
      for (int64_t layer = 0; layer < L; ++layer) table.push_back(dev_base + layer_base(layer));
      rc = kvb_vllm_block_side(&dev_side, &geom, &tensor, nullptr, table.data(), nullptr, L, err,
                               err_len);
    }
    if (rc == KVB_KERNEL_OK) {
      rc = kvb_page_buffer_side(&buf_side, &geom, buf_base, buf_pages, err, err_len);
    }
    if (rc != KVB_KERNEL_OK) return rc;
    const auto n = static_cast<int64_t>(out->src_pages.size());
    return save ? kvb_page_copy_desc_init(&out->desc, &dev_side, &geom, &buf_side, &geom,
                                          out->src_pages.data(), out->dst_pages.data(), n, err,
                                          err_len)
                : kvb_page_copy_desc_init(&out->desc, &buf_side, &geom, &dev_side, &geom,
                                          out->src_pages.data(), out->dst_pages.data(), n, err,
                                          err_len);
  };
  return c;
}

const char* EngineName(Engine e) {
  switch (e) {
    case Engine::kCpu:
      return "cpu";
    case Engine::kEmulatedKernel:
      return "emulated-kernel";
    case Engine::kEmulatedOneBlock:
      return "emulated-kernel-one-block";
    case Engine::kCuda:
      return "cuda";
    case Engine::kCudaDeviceTables:
      return "cuda-device-tables";
    case Engine::kCudaPinnedDst:
      return "cuda-pinned-dst";
  }
  return "?";
}

bool GpuRequired() {
  const char* v = std::getenv("KVBRIDGE_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

bool CudaUsable(std::string* why) {
  kvb_page_copy_desc empty = {};
  char err[512] = "";
  const int rc = kvb_page_copy_cuda(&empty, nullptr, err, sizeof(err));
  if (rc == KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA || rc == KVB_KERNEL_ERR_NO_CUDA_DEVICE) {
    *why = std::string(kvb_kernel_status_name(rc)) + ": " + err;
    return false;
  }
  return true;
}

namespace {

::testing::AssertionResult Compare(const char* what, const uint8_t* got, const uint8_t* want,
                                   size_t bytes, size_t payload_offset) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < bytes; ++i) {
    if (got[i] != want[i]) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const auto rel = static_cast<int64_t>(first) - static_cast<int64_t>(payload_offset);
  return ::testing::AssertionFailure()
         << what << ": " << bad << " bytes differ from the oracle; the first at payload offset "
         << rel << (rel < 0 ? " (leading guard)" : "") << ": got " << int{got[first]} << ", want "
         << int{want[first]};
}

// GPU memory that frees itself.
struct DeviceBuffer {
  void* ptr = nullptr;
  bool pinned = false;
  ~DeviceBuffer() { pinned ? kvb_cuda_free_host(ptr) : kvb_cuda_free(ptr); }
};

int RunEmulated(const Built& b, bool one_block, char* err, size_t err_len) {
  if (int rc = kvb_page_copy_validate(&b.desc, err, err_len); rc != KVB_KERNEL_OK) return rc;
  if (b.desc.n_pages == 0) return KVB_KERNEL_OK;
  auto params = std::make_unique<kvb_kernels::cuda::PageCopyParams>();
  int64_t grid = 0;
  if (int rc = kvb_kernels::cuda::BuildPageCopyParams(b.desc, params.get(), &grid, err, err_len);
      rc != KVB_KERNEL_OK) {
    return rc;
  }
  if (one_block) grid = 1;
  for (int64_t block = 0; block < grid; ++block) {
    for (int thread = 0; thread < kvb_kernels::cuda::kThreadsPerBlock; ++thread) {
      kvb_kernels::cuda::PageCopyThread(*params, block, thread, grid);
    }
  }
  return KVB_KERNEL_OK;
}

// Runs b's copy on the GPU over device copies of both regions, then copies them back.
::testing::AssertionResult RunOnCuda(const Case& c, Engine engine, Region* src, Region* dst) {
  char err[512] = "";
  auto fail = [&](const char* step) {
    return ::testing::AssertionFailure() << step << ": " << err;
  };
  DeviceBuffer dsrc, ddst, dsrc_pages, ddst_pages, dsrc_table, ddst_table;
  ddst.pinned = engine == Engine::kCudaPinnedDst;
  if (kvb_cuda_malloc(&dsrc.ptr, src->storage_bytes(), err, sizeof(err)) != KVB_KERNEL_OK) {
    return fail("cudaMalloc src");
  }
  const int rc_dst = ddst.pinned
                         ? kvb_cuda_malloc_host(&ddst.ptr, dst->storage_bytes(), err, sizeof(err))
                         : kvb_cuda_malloc(&ddst.ptr, dst->storage_bytes(), err, sizeof(err));
  if (rc_dst != KVB_KERNEL_OK) return fail("allocating dst");
  if (kvb_cuda_memcpy(dsrc.ptr, src->storage(), src->storage_bytes(), err, sizeof(err)) ||
      kvb_cuda_memcpy(ddst.ptr, dst->storage(), dst->storage_bytes(), err, sizeof(err))) {
    return fail("copying regions to the GPU");
  }
  Built b;
  b.src_pages = c.src_pages;
  b.dst_pages = c.dst_pages;
  if (c.build(static_cast<uint8_t*>(dsrc.ptr) + src->payload_offset(),
              static_cast<uint8_t*>(ddst.ptr) + dst->payload_offset(), &b, err,
              sizeof(err)) != KVB_KERNEL_OK) {
    return fail("build");
  }
  const size_t index_bytes = b.src_pages.size() * sizeof(int64_t);
  if (index_bytes > 0) {
    if (kvb_cuda_malloc(&dsrc_pages.ptr, index_bytes, err, sizeof(err)) ||
        kvb_cuda_malloc(&ddst_pages.ptr, index_bytes, err, sizeof(err)) ||
        kvb_cuda_memcpy(dsrc_pages.ptr, b.src_pages.data(), index_bytes, err, sizeof(err)) ||
        kvb_cuda_memcpy(ddst_pages.ptr, b.dst_pages.data(), index_bytes, err, sizeof(err))) {
      return fail("copying page indices to the GPU");
    }
    b.desc.src_pages = static_cast<const int64_t*>(dsrc_pages.ptr);
    b.desc.dst_pages = static_cast<const int64_t*>(ddst_pages.ptr);
  }
  if (engine == Engine::kCudaDeviceTables) {
    auto to_device = [&](kvb_page_side* side, const std::vector<void*>& table,
                         DeviceBuffer* d) -> int {
      if (side->layer_ptrs == nullptr) return KVB_KERNEL_OK;
      const size_t bytes = table.size() * sizeof(void*);
      int rc = kvb_cuda_malloc(&d->ptr, bytes, err, sizeof(err));
      if (rc == KVB_KERNEL_OK) rc = kvb_cuda_memcpy(d->ptr, table.data(), bytes, err, sizeof(err));
      // Keep the narrowing a per-layer selection applied to the host table.
      const ptrdiff_t shift = side->layer_ptrs - table.data();
      side->layer_ptrs_device = static_cast<void* const*>(d->ptr) + shift;
      side->layer_ptrs = nullptr;
      return rc;
    };
    if (to_device(&b.desc.src, b.src_table, &dsrc_table) ||
        to_device(&b.desc.dst, b.dst_table, &ddst_table)) {
      return fail("copying pointer tables to the GPU");
    }
  }
  if (kvb_page_copy_cuda(&b.desc, nullptr, err, sizeof(err)) != KVB_KERNEL_OK) {
    return fail("kvb_page_copy_cuda");
  }
  if (kvb_cuda_stream_synchronize(nullptr, err, sizeof(err)) != KVB_KERNEL_OK) {
    return fail("the kernel");
  }
  if (kvb_cuda_memcpy(src->storage(), dsrc.ptr, src->storage_bytes(), err, sizeof(err)) ||
      kvb_cuda_memcpy(dst->storage(), ddst.ptr, dst->storage_bytes(), err, sizeof(err))) {
    return fail("copying regions back");
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult RunCase(const Case& c, Engine engine, int threads) {
  Region src(c.src_bytes, c.src_misalign), dst(c.dst_bytes, c.dst_misalign);
  const uint64_t seed = std::hash<std::string>{}(c.name);
  src.FillRandom(seed);
  dst.FillRandom(seed ^ 0x5555);
  const std::vector<uint8_t> src_before(src.storage(), src.storage() + src.storage_bytes());
  std::vector<uint8_t> want(dst.storage(), dst.storage() + dst.storage_bytes());
  ApplyOracle(c, src.payload(), want.data() + dst.payload_offset());

  char err[512] = "";
  auto failure = [&](const char* step, int rc) {
    return ::testing::AssertionFailure()
           << c.name << " on " << EngineName(engine) << ": " << step << " returned "
           << kvb_kernel_status_name(rc) << ": " << err;
  };
  if (engine == Engine::kCuda || engine == Engine::kCudaDeviceTables ||
      engine == Engine::kCudaPinnedDst) {
    ::testing::AssertionResult r = RunOnCuda(c, engine, &src, &dst);
    if (!r)
      return ::testing::AssertionFailure()
             << c.name << " on " << EngineName(engine) << ": " << r.message();
  } else {
    Built b;
    b.src_pages = c.src_pages;
    b.dst_pages = c.dst_pages;
    int rc = c.build(src.payload(), dst.payload(), &b, err, sizeof(err));
    if (rc != KVB_KERNEL_OK) return failure("build", rc);
    rc = engine == Engine::kCpu
             ? kvb_page_copy_cpu(&b.desc, threads, err, sizeof(err))
             : RunEmulated(b, engine == Engine::kEmulatedOneBlock, err, sizeof(err));
    if (rc != KVB_KERNEL_OK) return failure("the copy", rc);
  }
  const std::string where =
      c.name + " on " + EngineName(engine) + " (" + std::to_string(threads) + " threads), ";
  ::testing::AssertionResult d = Compare((where + "destination").c_str(), dst.storage(),
                                         want.data(), want.size(), dst.payload_offset());
  if (!d) return d;
  return Compare((where + "source").c_str(), src.storage(), src_before.data(), src_before.size(),
                 src.payload_offset());
}

}  // namespace kvb_test
