// Test cases for the page-copy kernels and the byte-by-byte oracle they are checked against.
//
// A Case is two byte regions (each with guard bytes around it and a chosen misalignment), the
// page-index lists, a `build` function that describes the copy through the library's own
// helpers for regions at any address (host or GPU), and, independently of those helpers, two
// offset functions that say where byte `unit` of (kv, layer, page) lives in each region,
// written from the engines' tensor shapes. The oracle moves bytes one at a time with the
// offset functions; a run must leave the destination region, guards included, exactly as the
// oracle does, and the source unchanged.
#ifndef KVBRIDGE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define KVBRIDGE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "kvbridge/kernels/page_copy.h"

namespace kvb_test {

constexpr size_t kGuardBytes = 64;

// Host bytes laid out as [guard][misalign][payload][guard], the whole allocation 256-aligned
// so that a GPU copy (cudaMalloc is 256-aligned) has the same alignment everywhere.
class Region {
 public:
  Region(size_t payload_bytes, size_t misalign);
  uint8_t* storage() { return storage_; }
  const uint8_t* storage() const { return storage_; }
  size_t storage_bytes() const { return storage_bytes_; }
  size_t payload_offset() const { return kGuardBytes + misalign_; }
  uint8_t* payload() { return storage_ + payload_offset(); }
  const uint8_t* payload() const { return storage_ + payload_offset(); }
  void FillRandom(uint64_t seed);

 private:
  std::vector<uint8_t> buffer_;
  uint8_t* storage_ = nullptr;
  size_t storage_bytes_ = 0;
  size_t misalign_ = 0;
};

// Where byte `unit` (0 <= unit < chunk_bytes) of (kv, layer, page) lies in a region's payload.
using OffsetFn = std::function<int64_t(int64_t kv, int64_t layer, int64_t page, int64_t unit)>;

// A desc and the storage it points into.
struct Built {
  kvb_page_copy_desc desc = {};
  std::vector<void*> src_table, dst_table;
  std::vector<int64_t> src_pages, dst_pages;
};

struct Case {
  std::string name;
  size_t src_bytes = 0, dst_bytes = 0;
  size_t src_misalign = 0, dst_misalign = 0;
  OffsetFn src_offset, dst_offset;
  int64_t n_layers = 0, n_kv = 0, chunk_bytes = 0;
  std::vector<int64_t> src_pages, dst_pages;
  // Describes the copy for payloads at these addresses, with the library's helpers; out's
  // src_pages and dst_pages are already set (to this case's lists).
  std::function<int(uint8_t* src, uint8_t* dst, Built* out, char* err, size_t err_len)> build;
};

// dst_payload as the copy must leave it, byte by byte.
void ApplyOracle(const Case& c, const uint8_t* src_payload, uint8_t* dst_payload);

// ---- Cases -------------------------------------------------------------------------------

struct SglangShape {
  int64_t page_size, heads, head_dim;
};

// A copy between SGLang's device pool (per-layer (slots, H, D) tensors, K tables then V
// tables) and a host pool of `layout`. backup: device -> host; else host -> device (load).
// only_layer >= 0: SGLang's per-layer load/backup of that layer (n_layers = 1 in the desc).
Case SglangCase(kvb_sglang_layout layout, bool backup, bool mla, int64_t elem_bytes,
                SglangShape shape, int64_t n_layers, uint64_t seed, int64_t only_layer = -1);

// The odd and plain shapes every SGLang layout is tried with.
std::vector<SglangShape> SglangShapes();

// A vLLM block-tensor layout: logical shape and strides in elements.
struct VllmLayout {
  std::string name;
  std::vector<int64_t> shape, strides;
  int block_dim, kv_dim, layer_dim;
};

inline void PrintTo(const VllmLayout& l, std::ostream* os) { *os << l.name; }

// Strides of a tensor stored densely in `physical` order (outermost logical dim first).
std::vector<int64_t> StridesFor(const std::vector<int64_t>& shape,
                                const std::vector<int>& physical);

// The vLLM layouts tried: FlashAttention, FlashInfer, HND, packed K|V, MLA, padded, cross-layer.
std::vector<VllmLayout> VllmLayouts();

// vLLM tensors (per-layer, or one cross-layer tensor) <-> a contiguous page buffer.
// save: tensors -> buffer; else buffer -> tensors.
Case VllmCase(const VllmLayout& layout, int64_t elem_bytes, bool save, uint64_t seed);

// ---- Running -----------------------------------------------------------------------------

enum class Engine {
  kCpu,               // kvb_page_copy_cpu
  kEmulatedKernel,    // the CUDA kernel's code, thread by thread on the CPU, launcher's grid
  kEmulatedOneBlock,  // the same with a one-block grid (every grid-stride step taken)
  kCuda,              // kvb_page_copy_cuda, device memory, host tables inline
  kCudaDeviceTables,  // kvb_page_copy_cuda, tables only in device memory
  kCudaPinnedDst,     // kvb_page_copy_cuda into pinned host memory
};

const char* EngineName(Engine e);

// Runs c on engine and compares both regions with the oracle's result.
::testing::AssertionResult RunCase(const Case& c, Engine engine, int threads = 1);

// Whether kvb_page_copy_cuda can run here; when not, *why is the launcher's message.
bool CudaUsable(std::string* why);

// GTEST_SKIPs (or fails, with KVBRIDGE_REQUIRE_GPU=1 as benchmarks/gpu_check.sh sets) when the
// CUDA path cannot run here.
#define KVB_REQUIRE_CUDA_OR_SKIP()                                                      \
  do {                                                                                  \
    std::string why_;                                                                   \
    if (!::kvb_test::CudaUsable(&why_)) {                                               \
      if (::kvb_test::GpuRequired()) FAIL() << "KVBRIDGE_REQUIRE_GPU is set: " << why_; \
      GTEST_SKIP() << why_;                                                             \
    }                                                                                   \
  } while (0)

bool GpuRequired();

}  // namespace kvb_test

#endif  // KVBRIDGE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
