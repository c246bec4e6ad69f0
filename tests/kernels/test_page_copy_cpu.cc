// The CPU reference and the CUDA kernel's code (emulated thread by thread on the CPU) against
// the byte-by-byte oracle: every SGLang layout x direction x dtype size x MHA/MLA, odd shapes,
// per-layer copies, vLLM block layouts, several thread counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/page_copy_kernel.cuh"
#include "kernels/cuda/page_copy_params.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvb_test {
namespace {

constexpr int64_t kLayers = 3;
constexpr int64_t kElemBytes[] = {1, 2, 4};  // fp8, bf16/fp16, fp32

struct SglangParam {
  kvb_sglang_layout layout;
  bool backup;  // device -> host; else host -> device
  bool mla;
};

void PrintTo(const SglangParam& p, std::ostream* os) {
  *os << kvb_sglang_layout_name(p.layout) << (p.backup ? " backup" : " load")
      << (p.mla ? " MLA" : " MHA");
}

std::string SglangParamName(const ::testing::TestParamInfo<SglangParam>& info) {
  return std::string(kvb_sglang_layout_name(info.param.layout)) +
         (info.param.backup ? "_backup" : "_load") + (info.param.mla ? "_mla" : "_mha");
}

std::vector<SglangParam> AllSglangParams() {
  std::vector<SglangParam> v;
  for (auto layout :
       {KVB_SGLANG_LAYER_FIRST, KVB_SGLANG_PAGE_FIRST, KVB_SGLANG_PAGE_FIRST_DIRECT}) {
    for (bool backup : {true, false}) {
      for (bool mla : {false, true}) v.push_back({layout, backup, mla});
    }
  }
  return v;
}

// Every dtype size and shape for one (layout, direction, MHA/MLA).
std::vector<Case> SglangCases(const SglangParam& p) {
  std::vector<Case> cases;
  uint64_t seed = 0;
  for (int64_t es : kElemBytes) {
    for (const SglangShape& shape : SglangShapes()) {
      cases.push_back(SglangCase(p.layout, p.backup, p.mla, es, shape, kLayers, seed++));
    }
  }
  return cases;
}

class SglangLayoutTest : public ::testing::TestWithParam<SglangParam> {};

TEST_P(SglangLayoutTest, CpuMatchesOracleForEveryDtypeShapeAndThreadCount) {
  for (const Case& c : SglangCases(GetParam())) {
    for (int threads : {1, 2, 3, 0}) EXPECT_TRUE(RunCase(c, Engine::kCpu, threads));
  }
}

TEST_P(SglangLayoutTest, EmulatedKernelMatchesOracle) {
  for (const Case& c : SglangCases(GetParam())) {
    EXPECT_TRUE(RunCase(c, Engine::kEmulatedKernel));
    EXPECT_TRUE(RunCase(c, Engine::kEmulatedOneBlock));
  }
}

TEST_P(SglangLayoutTest, PerLayerCopyTouchesOnlyThatLayer) {
  const SglangParam& p = GetParam();
  uint64_t seed = 100;
  for (int64_t layer : {int64_t{0}, kLayers - 1}) {
    for (const SglangShape& shape : {SglangShapes()[1], SglangShapes()[2]}) {
      const Case c = SglangCase(p.layout, p.backup, p.mla, 2, shape, kLayers, seed++, layer);
      EXPECT_TRUE(RunCase(c, Engine::kCpu, 2));
      EXPECT_TRUE(RunCase(c, Engine::kEmulatedKernel));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, SglangLayoutTest, ::testing::ValuesIn(AllSglangParams()),
                         SglangParamName);

class VllmLayoutTest : public ::testing::TestWithParam<VllmLayout> {};

TEST_P(VllmLayoutTest, SaveAndLoadMatchOracle) {
  uint64_t seed = 0;
  for (int64_t es : kElemBytes) {
    for (bool save : {true, false}) {
      const Case c = VllmCase(GetParam(), es, save, seed++);
      for (int threads : {1, 3, 0}) EXPECT_TRUE(RunCase(c, Engine::kCpu, threads));
      EXPECT_TRUE(RunCase(c, Engine::kEmulatedKernel));
      EXPECT_TRUE(RunCase(c, Engine::kEmulatedOneBlock));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, VllmLayoutTest, ::testing::ValuesIn(VllmLayouts()),
                         [](const ::testing::TestParamInfo<VllmLayout>& info) {
                           return info.param.name;
                         });

// Contiguous buffers on both sides: the one-memcpy-per-chunk path, many pages, more threads
// than the machine has cores.
TEST(PageCopyCpu, ManyPagesManyThreads) {
  const int64_t rows = 8, row_bytes = 96, n_layers = 2, n_kv = 2, pages = 40;
  const kvb_page_geometry g = {n_layers, n_kv, rows, row_bytes};
  const int64_t page_bytes = n_layers * n_kv * rows * row_bytes;
  std::vector<uint8_t> src(static_cast<size_t>(pages * page_bytes));
  std::vector<uint8_t> dst(src.size(), 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  std::vector<int64_t> src_pages, dst_pages;
  for (int64_t i = 0; i < pages; ++i) {
    src_pages.push_back(i);
    dst_pages.push_back(pages - 1 - i);
  }
  char err[256] = "";
  kvb_page_side s, d;
  ASSERT_EQ(kvb_page_buffer_side(&s, &g, src.data(), pages, err, sizeof(err)), KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_buffer_side(&d, &g, dst.data(), pages, err, sizeof(err)), KVB_KERNEL_OK);
  kvb_page_copy_desc desc;
  ASSERT_EQ(kvb_page_copy_desc_init(&desc, &s, &g, &d, &g, src_pages.data(), dst_pages.data(),
                                    pages, err, sizeof(err)),
            KVB_KERNEL_OK)
      << err;
  for (int threads : {1, 7, 16, 64, 0}) {
    std::fill(dst.begin(), dst.end(), 0xEE);
    ASSERT_EQ(kvb_page_copy_cpu(&desc, threads, err, sizeof(err)), KVB_KERNEL_OK) << err;
    for (int64_t i = 0; i < pages; ++i) {
      ASSERT_EQ(0, std::memcmp(dst.data() + (pages - 1 - i) * page_bytes,
                               src.data() + i * page_bytes, static_cast<size_t>(page_bytes)))
          << "page " << i << " with " << threads << " threads";
    }
  }
}

TEST(PageCopyCpu, AllEntriesSkippedLeavesDestinationAlone) {
  Case c = SglangCase(KVB_SGLANG_PAGE_FIRST, true, false, 2, SglangShapes()[2], kLayers, 1);
  for (size_t i = 0; i < c.src_pages.size(); ++i) {
    (i % 2 ? c.src_pages : c.dst_pages)[i] = -1 - static_cast<int64_t>(i);
  }
  // The oracle copies nothing either, so RunCase checks that no destination byte changed.
  EXPECT_TRUE(RunCase(c, Engine::kCpu, 2));
  EXPECT_TRUE(RunCase(c, Engine::kEmulatedKernel));
}

TEST(PageCopyCpu, ZeroPagesIsANoOpEvenWithoutIndexArrays) {
  std::vector<uint8_t> a(64), b(64, 1);
  const kvb_page_geometry g = {1, 1, 1, 16};
  kvb_page_side s, d;
  char err[256] = "";
  ASSERT_EQ(kvb_page_buffer_side(&s, &g, a.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_buffer_side(&d, &g, b.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  kvb_page_copy_desc desc;
  ASSERT_EQ(kvb_page_copy_desc_init(&desc, &s, &g, &d, &g, nullptr, nullptr, 0, err, sizeof(err)),
            KVB_KERNEL_OK)
      << err;
  EXPECT_EQ(kvb_page_copy_cpu(&desc, 4, err, sizeof(err)), KVB_KERNEL_OK) << err;
  EXPECT_EQ(b, std::vector<uint8_t>(64, 1));
}

TEST(PageCopyCpu, IndexOutOfRangeIsReportedBeforeAnyByteMoves) {
  std::vector<uint8_t> a(4 * 32, 7), b(4 * 32, 1);
  const kvb_page_geometry g = {1, 1, 2, 16};
  kvb_page_side s, d;
  char err[256] = "";
  ASSERT_EQ(kvb_page_buffer_side(&s, &g, a.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_buffer_side(&d, &g, b.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  const int64_t src_pages[] = {0, 1, 2};
  const int64_t dst_pages[] = {3, 2, 4};
  kvb_page_copy_desc desc;
  ASSERT_EQ(
      kvb_page_copy_desc_init(&desc, &s, &g, &d, &g, src_pages, dst_pages, 3, err, sizeof(err)),
      KVB_KERNEL_OK);
  EXPECT_EQ(kvb_page_copy_cpu(&desc, 1, err, sizeof(err)), KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE);
  EXPECT_STREQ(err, "dst_pages[2] = 4 but dst.num_pages is 4");
  EXPECT_EQ(b, std::vector<uint8_t>(4 * 32, 1));
}

// The GPU cannot report a bad index (it reads them from device memory): it skips the entry
// instead of writing out of bounds. Checked here on the kernel's code run on the CPU.
TEST(EmulatedKernel, IndicesBeyondNumPagesAreSkipped) {
  const kvb_page_geometry g = {1, 1, 2, 32};
  std::vector<uint8_t> src(4 * 64), dst(4 * 64, 0xAB);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i);
  kvb_page_side s, d;
  char err[256] = "";
  ASSERT_EQ(kvb_page_buffer_side(&s, &g, src.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_buffer_side(&d, &g, dst.data(), 4, err, sizeof(err)), KVB_KERNEL_OK);
  const int64_t src_pages[] = {0, 9, 2};
  const int64_t dst_pages[] = {1, 2, 4};
  kvb_page_copy_desc desc;
  ASSERT_EQ(
      kvb_page_copy_desc_init(&desc, &s, &g, &d, &g, src_pages, dst_pages, 3, err, sizeof(err)),
      KVB_KERNEL_OK);
  auto params = std::make_unique<kvb_kernels::cuda::PageCopyParams>();
  int64_t grid = 0;
  ASSERT_EQ(kvb_kernels::cuda::BuildPageCopyParams(desc, params.get(), &grid, err, sizeof(err)),
            KVB_KERNEL_OK);
  for (int64_t block = 0; block < grid; ++block) {
    for (int t = 0; t < kvb_kernels::cuda::kThreadsPerBlock; ++t) {
      kvb_kernels::cuda::PageCopyThread(*params, block, t, grid);
    }
  }
  std::vector<uint8_t> want(dst.size(), 0xAB);
  std::memcpy(want.data() + 64, src.data(), 64);
  EXPECT_EQ(dst, want);
}

}  // namespace
}  // namespace kvb_test
