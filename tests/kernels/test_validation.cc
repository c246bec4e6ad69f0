// kvb_page_copy_validate and the checks of the CPU path and the CUDA launcher's host half:
// each malformed desc is refused with a message naming the field, and nothing is copied.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/page_copy_params.h"
#include "kvbridge/kernels/page_copy.h"

namespace {

// A valid MHA copy: device-like per-layer tables -> a page_first host pool.
struct Fixture {
  static constexpr int64_t kLayers = 2, kSlots = 32, kPage = 4, kRow = 64;
  std::vector<uint8_t> device = std::vector<uint8_t>(2 * kLayers * kSlots * kRow);
  std::vector<uint8_t> host = std::vector<uint8_t>(2 * kLayers * kSlots * kRow);
  std::vector<void*> table;
  int64_t src_pages[3] = {0, 3, 5};
  int64_t dst_pages[3] = {1, 2, 7};
  kvb_page_copy_desc desc = {};

  Fixture() {
    for (int64_t i = 0; i < 2 * kLayers; ++i) table.push_back(device.data() + i * kSlots * kRow);
    kvb_page_side dev, host_side;
    kvb_page_geometry g1, g2;
    char err[256];
    EXPECT_EQ(kvb_sglang_device_side(&dev, &g1, table.data(), nullptr, kLayers, 2, kSlots, kPage,
                                     kRow, err, sizeof(err)),
              KVB_KERNEL_OK);
    EXPECT_EQ(kvb_sglang_host_side(&host_side, &g2, KVB_SGLANG_PAGE_FIRST, host.data(), kLayers, 2,
                                   kSlots, kPage, kRow, err, sizeof(err)),
              KVB_KERNEL_OK);
    EXPECT_EQ(kvb_page_copy_desc_init(&desc, &dev, &g1, &host_side, &g2, src_pages, dst_pages, 3,
                                      err, sizeof(err)),
              KVB_KERNEL_OK)
        << err;
  }
};

struct Misuse {
  const char* name;
  std::function<void(kvb_page_copy_desc&)> apply;
  const char* message;  // expected substring
};

class ValidationTest : public ::testing::TestWithParam<Misuse> {};

TEST_P(ValidationTest, RefusedWithAMessageNamingTheField) {
  Fixture f;
  char err[512] = "";
  ASSERT_EQ(kvb_page_copy_validate(&f.desc, err, sizeof(err)), KVB_KERNEL_OK) << err;
  GetParam().apply(f.desc);
  const std::vector<uint8_t> host_before = f.host;
  EXPECT_EQ(kvb_page_copy_validate(&f.desc, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find(GetParam().message), std::string::npos)
      << "message: " << err << "\nexpected to contain: " << GetParam().message;
  std::strcpy(err, "");
  EXPECT_EQ(kvb_page_copy_cpu(&f.desc, 2, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find(GetParam().message), std::string::npos) << err;
  EXPECT_EQ(f.host, host_before);
}

const Misuse kMisuses[] = {
    {"negative_n_pages", [](kvb_page_copy_desc& d) { d.n_pages = -1; }, "n_pages is -1"},
    {"null_src_pages", [](kvb_page_copy_desc& d) { d.src_pages = nullptr; },
     "src_pages is NULL with n_pages = 3"},
    {"null_dst_pages", [](kvb_page_copy_desc& d) { d.dst_pages = nullptr; }, "dst_pages is NULL"},
    {"zero_layers", [](kvb_page_copy_desc& d) { d.n_layers = 0; }, "n_layers is 0"},
    {"zero_kv", [](kvb_page_copy_desc& d) { d.n_kv = 0; }, "n_kv is 0"},
    {"zero_rows", [](kvb_page_copy_desc& d) { d.rows = 0; }, "rows is 0"},
    {"negative_row_bytes", [](kvb_page_copy_desc& d) { d.row_bytes = -8; }, "row_bytes is -8"},
    {"overflowing_chunk",
     [](kvb_page_copy_desc& d) {
       d.rows = int64_t{1} << 40;
       d.row_bytes = int64_t{1} << 40;
     },
     "overflows 64 bits"},
    {"no_base_no_table", [](kvb_page_copy_desc& d) { d.dst.base = nullptr; },
     "dst.base is NULL and dst has no layer_ptrs table"},
    {"negative_stride", [](kvb_page_copy_desc& d) { d.dst.page_stride_bytes = -512; },
     "dst.page_stride_bytes is -512"},
    {"negative_num_pages", [](kvb_page_copy_desc& d) { d.src.num_pages = -2; },
     "src.num_pages is -2"},
    {"src_rows_overlap", [](kvb_page_copy_desc& d) { d.src.row_stride_bytes = 32; },
     "src.row_stride_bytes (32) is smaller than row_bytes (64)"},
    {"dst_rows_overlap", [](kvb_page_copy_desc& d) { d.dst.row_stride_bytes = 32; },
     "dst.row_stride_bytes (32) is smaller than row_bytes (64)"},
    {"zero_page_stride", [](kvb_page_copy_desc& d) { d.src.page_stride_bytes = 0; },
     "src.page_stride_bytes is 0"},
    {"zero_layer_stride", [](kvb_page_copy_desc& d) { d.dst.layer_stride_bytes = 0; },
     "dst.layer_stride_bytes is 0 with n_layers = 2"},
    {"zero_kv_stride", [](kvb_page_copy_desc& d) { d.dst.kv_stride_bytes = 0; },
     "dst.kv_stride_bytes is 0 with n_kv = 2"},
    {"table_without_kv_split", [](kvb_page_copy_desc& d) { d.src.table_kv_stride = 0; },
     "src has a layer table and n_kv = 2"},
    {"table_kv_stride_too_small", [](kvb_page_copy_desc& d) { d.src.table_kv_stride = 1; },
     "src.table_kv_stride (1) is smaller than n_layers (2)"},
    // page_first rows of one layer are 128 bytes apart; pages must be 4 such rows apart.
    {"dst_pages_overlap", [](kvb_page_copy_desc& d) { d.dst.page_stride_bytes = 256; },
     "dst overlaps itself: dst.page_stride_bytes is 256 bytes, less than the 512 bytes spanned "
     "by the rows and layers inside it, so two pages would write the same bytes"},
    {"dst_layers_overlap_rows", [](kvb_page_copy_desc& d) { d.dst.layer_stride_bytes = 32; },
     "dst overlaps itself: dst.layer_stride_bytes is 32 bytes, less than the 64 bytes spanned "
     "by one row"},
    {"dst_kv_inside_pages", [](kvb_page_copy_desc& d) { d.dst.kv_stride_bytes = 1024; },
     "dst overlaps itself: dst.kv_stride_bytes is 1024 bytes"},
};

INSTANTIATE_TEST_SUITE_P(Misuses, ValidationTest, ::testing::ValuesIn(kMisuses),
                         [](const ::testing::TestParamInfo<Misuse>& info) {
                           return std::string(info.param.name);
                         });

TEST(Validation, NullDesc) {
  char err[128] = "";
  EXPECT_EQ(kvb_page_copy_validate(nullptr, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "desc is NULL");
  EXPECT_EQ(kvb_page_copy_cpu(nullptr, 1, nullptr, 0), KVB_KERNEL_ERR_INVALID_ARGUMENT);
}

TEST(Validation, MessagesAreTruncatedToTheBuffer) {
  char err[8];
  std::memset(err, 'x', sizeof(err));
  EXPECT_EQ(kvb_page_copy_validate(nullptr, err, 5), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "desc");
  EXPECT_EQ(err[5], 'x');
}

TEST(Validation, AnOverlappingSourceIsAllowed) {
  // Reading the same bytes twice is harmless (e.g. one source page fanned out).
  Fixture f;
  f.desc.src.page_stride_bytes = 64;
  char err[256] = "";
  EXPECT_EQ(kvb_page_copy_validate(&f.desc, err, sizeof(err)), KVB_KERNEL_OK) << err;
}

TEST(Validation, UnknownPageCountStillChecksWhatIsInsideAPage) {
  Fixture f;
  f.desc.dst.num_pages = 0;
  char err[256] = "";
  EXPECT_EQ(kvb_page_copy_validate(&f.desc, err, sizeof(err)), KVB_KERNEL_OK) << err;
  f.desc.dst.page_stride_bytes = 128;
  EXPECT_EQ(kvb_page_copy_validate(&f.desc, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("dst.page_stride_bytes is 128"), std::string::npos) << err;
}

TEST(Validation, DescInitNamesTheGeometryFieldThatDiffers) {
  std::vector<uint8_t> a(4096), b(4096);
  const kvb_page_geometry ga = {2, 2, 4, 64}, gb = {2, 2, 8, 64};
  kvb_page_side sa, sb;
  char err[256] = "";
  ASSERT_EQ(kvb_page_buffer_side(&sa, &ga, a.data(), 0, err, sizeof(err)), KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_buffer_side(&sb, &gb, b.data(), 0, err, sizeof(err)), KVB_KERNEL_OK);
  kvb_page_copy_desc d;
  const int64_t pages[] = {0};
  EXPECT_EQ(kvb_page_copy_desc_init(&d, &sa, &ga, &sb, &gb, pages, pages, 1, err, sizeof(err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "the sides disagree on rows: src has 4, dst has 8");
}

TEST(CpuChecks, NullTableEntry) {
  Fixture f;
  f.table[3] = nullptr;
  char err[256] = "";
  EXPECT_EQ(kvb_page_copy_cpu(&f.desc, 1, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "src.layer_ptrs[3] (kv 1, layer 1) is NULL");
}

TEST(CpuChecks, DeviceOnlyTableIsNotReadableOnTheCpu) {
  Fixture f;
  f.desc.src.layer_ptrs_device = f.desc.src.layer_ptrs;
  f.desc.src.layer_ptrs = nullptr;
  char err[256] = "";
  EXPECT_EQ(kvb_page_copy_cpu(&f.desc, 1, err, sizeof(err)), KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("src has only layer_ptrs_device"), std::string::npos) << err;
}

TEST(CpuChecks, SourceIndexOutOfRange) {
  Fixture f;
  f.src_pages[1] = 8;  // the device side has 32 / 4 pages
  char err[256] = "";
  EXPECT_EQ(kvb_page_copy_cpu(&f.desc, 1, err, sizeof(err)), KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE);
  EXPECT_STREQ(err, "src_pages[1] = 8 but src.num_pages is 8");
}

// The CUDA launcher's host half, which needs no GPU.
TEST(CudaParams, InlineTablesArePackedAndBounded) {
  Fixture f;
  auto params = std::make_unique<kvb_kernels::cuda::PageCopyParams>();
  int64_t grid = 0;
  char err[512] = "";
  ASSERT_EQ(kvb_kernels::cuda::BuildPageCopyParams(f.desc, params.get(), &grid, err, sizeof(err)),
            KVB_KERNEL_OK)
      << err;
  EXPECT_EQ(params->src.inline_offset, 0);
  EXPECT_EQ(params->src.table_kv_stride, 2);
  EXPECT_EQ(params->inline_ptrs[3], static_cast<const char*>(f.table[3]));
  EXPECT_EQ(params->dst.inline_offset, -1);
  EXPECT_EQ(params->dst.base, reinterpret_cast<const char*>(f.host.data()));
  // 4 rows x 64 bytes per chunk: one warp each, 8 chunks per block, 12 chunks.
  EXPECT_EQ(params->chunks_per_block, 8);
  EXPECT_EQ(grid, 2);

  std::vector<void*> big(2 * KVB_PAGE_COPY_CUDA_INLINE_PTRS, f.device.data());
  f.desc.src.layer_ptrs = big.data();
  f.desc.src.table_kv_stride = KVB_PAGE_COPY_CUDA_INLINE_PTRS;
  f.desc.n_layers = KVB_PAGE_COPY_CUDA_INLINE_PTRS / 2 + 1;
  EXPECT_EQ(kvb_kernels::cuda::BuildPageCopyParams(f.desc, params.get(), &grid, err, sizeof(err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("set src.layer_ptrs_device"), std::string::npos) << err;
  f.desc.src.layer_ptrs_device = big.data();
  EXPECT_EQ(kvb_kernels::cuda::BuildPageCopyParams(f.desc, params.get(), &grid, err, sizeof(err)),
            KVB_KERNEL_OK)
      << err;
  EXPECT_EQ(params->src.inline_offset, -1);
}

TEST(CudaParams, ChunkSizePicksThreadsPerChunk) {
  Fixture f;
  auto params = std::make_unique<kvb_kernels::cuda::PageCopyParams>();
  int64_t grid = 0;
  char err[256] = "";
  const struct {
    int64_t rows, row_bytes;
    int chunks_per_block;
  } cases[] = {{1, 2048, 8}, {1, 2049, 4}, {2, 4096, 2}, {4, 4096, 1}, {1, 1 << 20, 1}};
  for (const auto& c : cases) {
    f.desc.rows = c.rows;
    f.desc.row_bytes = c.row_bytes;
    ASSERT_EQ(kvb_kernels::cuda::BuildPageCopyParams(f.desc, params.get(), &grid, err, sizeof(err)),
              KVB_KERNEL_OK);
    EXPECT_EQ(params->chunks_per_block, c.chunks_per_block) << c.rows << " x " << c.row_bytes;
  }
}

TEST(StatusNames, EveryCodeHasAName) {
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_OK), "OK");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_INDEX_OUT_OF_RANGE), "INDEX_OUT_OF_RANGE");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA), "NOT_BUILT_WITH_CUDA");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_NO_CUDA_DEVICE), "NO_CUDA_DEVICE");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_CUDA), "CUDA");
  EXPECT_STREQ(kvb_kernel_status_name(KVB_KERNEL_ERR_INTERNAL), "INTERNAL");
  EXPECT_STREQ(kvb_kernel_status_name(99), "UNKNOWN");
}

}  // namespace
