// kvb_page_copy_cuda on a GPU against the same oracle as the CPU reference, with device
// memory, device-resident pointer tables and pinned host memory. Where the build has no CUDA
// or the machine no GPU, each test skips with the launcher's reason (and fails instead under
// KVBRIDGE_REQUIRE_GPU=1, as benchmarks/gpu_check.sh runs them).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/kernels/cuda_memory.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvb_test {
namespace {

constexpr Engine kCudaEngines[] = {Engine::kCuda, Engine::kCudaDeviceTables,
                                   Engine::kCudaPinnedDst};

TEST(PageCopyCuda, LauncherReportsAvailabilityBeforeLookingAtTheDesc) {
  kvb_page_copy_desc empty = {};
  char err[512] = "";
  const int rc = kvb_page_copy_cuda(&empty, nullptr, err, sizeof(err));
  int count = -1;
  char count_err[512] = "";
  const int count_rc = kvb_cuda_device_count(&count, count_err, sizeof(count_err));
  if (rc == KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA || rc == KVB_KERNEL_ERR_NO_CUDA_DEVICE) {
    std::printf("CUDA path unavailable here: %s: %s\n", kvb_kernel_status_name(rc), err);
    EXPECT_EQ(count_rc, rc);
    EXPECT_EQ(count, 0);
    EXPECT_NE(std::string(err), "");
  } else {
    // A GPU is there: the zeroed desc itself is what's wrong.
    EXPECT_EQ(rc, KVB_KERNEL_ERR_INVALID_ARGUMENT) << err;
    EXPECT_EQ(count_rc, KVB_KERNEL_OK) << count_err;
    EXPECT_GT(count, 0);
  }
}

TEST(PageCopyCuda, SglangEveryLayoutDirectionDtypeAndShape) {
  KVB_REQUIRE_CUDA_OR_SKIP();
  char name[256] = "";
  char err[256] = "";
  if (kvb_cuda_device_name(name, sizeof(name), err, sizeof(err)) == KVB_KERNEL_OK) {
    std::printf("device: %s\n", name);
  }
  uint64_t seed = 0;
  for (auto layout :
       {KVB_SGLANG_LAYER_FIRST, KVB_SGLANG_PAGE_FIRST, KVB_SGLANG_PAGE_FIRST_DIRECT}) {
    for (bool backup : {true, false}) {
      for (bool mla : {false, true}) {
        for (int64_t es : {1, 2, 4}) {
          for (const SglangShape& shape : SglangShapes()) {
            const Case c = SglangCase(layout, backup, mla, es, shape, 3, seed++);
            for (Engine e : kCudaEngines) EXPECT_TRUE(RunCase(c, e));
          }
        }
        const Case per_layer =
            SglangCase(layout, backup, mla, 2, SglangShapes()[1], 3, seed++, /*only_layer=*/1);
        for (Engine e : kCudaEngines) EXPECT_TRUE(RunCase(per_layer, e));
      }
    }
  }
}

TEST(PageCopyCuda, VllmEveryLayoutBothDirections) {
  KVB_REQUIRE_CUDA_OR_SKIP();
  uint64_t seed = 0;
  for (const VllmLayout& layout : VllmLayouts()) {
    for (int64_t es : {1, 2, 4}) {
      for (bool save : {true, false}) {
        const Case c = VllmCase(layout, es, save, seed++);
        for (Engine e : kCudaEngines) EXPECT_TRUE(RunCase(c, e));
      }
    }
  }
}

// More table entries than the kernel's arguments hold: refused with a pointer to
// layer_ptrs_device, and correct once the table is in device memory.
TEST(PageCopyCuda, LargeTablesNeedDeviceCopies) {
  KVB_REQUIRE_CUDA_OR_SKIP();
  const int64_t layers = KVB_PAGE_COPY_CUDA_INLINE_PTRS / 2 + 1;
  const Case c = SglangCase(KVB_SGLANG_PAGE_FIRST, true, false, 2, {2, 1, 8}, layers, 3);
  const ::testing::AssertionResult inline_run = RunCase(c, Engine::kCuda);
  ASSERT_FALSE(inline_run);
  EXPECT_NE(std::string(inline_run.message()).find("layer_ptrs_device"), std::string::npos)
      << inline_run.message();
  EXPECT_TRUE(RunCase(c, Engine::kCudaDeviceTables));
}

}  // namespace
}  // namespace kvb_test
