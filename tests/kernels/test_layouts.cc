// The layout helpers: the strides each SGLang and vLLM layout turns into, SGLang slot lists,
// per-layer selection, and the helpers' argument checks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/kernels/page_copy.h"
#include "tests/kernels/kernel_test_util.h"

namespace {

char g_err[512];

struct Expect {
  int64_t kv, layer, page, row, num_pages;
};

void ExpectSide(const kvb_page_side& s, const Expect& e) {
  EXPECT_EQ(s.kv_stride_bytes, e.kv);
  EXPECT_EQ(s.layer_stride_bytes, e.layer);
  EXPECT_EQ(s.page_stride_bytes, e.page);
  EXPECT_EQ(s.row_stride_bytes, e.row);
  EXPECT_EQ(s.num_pages, e.num_pages);
}

TEST(SglangHostSide, StridesOfEachLayout) {
  // L = 4 layers, S = 64 slots, P = 16, R = 3 heads x 128 x bf16 = 768 bytes.
  const int64_t L = 4, S = 64, P = 16, R = 768;
  char base;
  kvb_page_side s;
  kvb_page_geometry g;
  ASSERT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_LAYER_FIRST, &base, L, 2, S, P, R, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_OK);
  ExpectSide(s, {L * S * R, S * R, P * R, R, S / P});
  EXPECT_EQ(s.base, &base);
  EXPECT_EQ(g.n_layers, L);
  EXPECT_EQ(g.n_kv, 2);
  EXPECT_EQ(g.rows, P);
  EXPECT_EQ(g.row_bytes, R);
  ASSERT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST, &base, L, 2, S, P, R, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_OK);
  ExpectSide(s, {S * L * R, R, P * L * R, L * R, S / P});
  ASSERT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST_DIRECT, &base, L, 1, S, P, R, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_OK);
  ExpectSide(s, {S * L * R, P * R, L * P * R, R, S / P});
  EXPECT_EQ(g.n_kv, 1);
}

TEST(SglangHostSide, ArgumentChecks) {
  char base;
  kvb_page_side s;
  kvb_page_geometry g;
  EXPECT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST, &base, 4, 2, 60, 16, 64, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_host_side: total_slots (60) is not a multiple of page_size (16)");
  EXPECT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST, &base, 4, 3, 64, 16, 64, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_host_side: n_kv is 3; it must be 2 (MHA) or 1 (MLA)");
  EXPECT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST, nullptr, 4, 2, 64, 16, 64, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_host_side: base is NULL");
  EXPECT_EQ(kvb_sglang_host_side(&s, &g, static_cast<kvb_sglang_layout>(7), &base, 4, 2, 64, 16, 64,
                                 g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_host_side: unknown layout 7");
  EXPECT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_PAGE_FIRST, &base, 0, 2, 64, 16, 64, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_host_side: n_layers is 0; it must be >= 1");
  EXPECT_STREQ(kvb_sglang_layout_name(KVB_SGLANG_PAGE_FIRST_DIRECT), "page_first_direct");
  EXPECT_STREQ(kvb_sglang_layout_name(static_cast<kvb_sglang_layout>(9)), "unknown");
}

TEST(SglangDeviceSide, KTablesThenVTables) {
  std::vector<void*> table(6, &g_err);
  kvb_page_side s;
  kvb_page_geometry g;
  ASSERT_EQ(kvb_sglang_device_side(&s, &g, table.data(), nullptr, 3, 2, 16 * 9, 16, 256, g_err,
                                   sizeof(g_err)),
            KVB_KERNEL_OK);
  EXPECT_EQ(s.layer_ptrs, table.data());
  EXPECT_EQ(s.table_kv_stride, 3);
  ExpectSide(s, {0, 0, 16 * 256, 256, 9});
  ASSERT_EQ(
      kvb_sglang_device_side(&s, &g, table.data(), nullptr, 3, 1, 0, 1, 576, g_err, sizeof(g_err)),
      KVB_KERNEL_OK);
  EXPECT_EQ(s.table_kv_stride, 0);
  EXPECT_EQ(s.num_pages, 0);  // unknown
  EXPECT_EQ(
      kvb_sglang_device_side(&s, &g, nullptr, nullptr, 3, 2, 0, 16, 256, g_err, sizeof(g_err)),
      KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("layer_ptrs and layer_ptrs_device are both NULL"),
            std::string::npos);
}

TEST(SglangSlotsToPages, WholeAlignedPages) {
  const int64_t slots[] = {32, 33, 34, 35, 8, 9, 10, 11, -1, -1, -1, -1};
  int64_t pages[3] = {0, 0, 0};
  ASSERT_EQ(kvb_sglang_slots_to_pages(slots, 12, 4, pages, g_err, sizeof(g_err)), KVB_KERNEL_OK);
  EXPECT_EQ(pages[0], 8);
  EXPECT_EQ(pages[1], 2);
  EXPECT_EQ(pages[2], -1);
  const int64_t tokens[] = {5, 0, 77};
  int64_t single[3];
  ASSERT_EQ(kvb_sglang_slots_to_pages(tokens, 3, 1, single, g_err, sizeof(g_err)), KVB_KERNEL_OK);
  EXPECT_EQ(single[2], 77);
}

TEST(SglangSlotsToPages, RefusesPartialOrMisalignedPages) {
  int64_t pages[2] = {-5, -5};
  const int64_t misaligned[] = {2, 3, 4, 5};
  EXPECT_EQ(kvb_sglang_slots_to_pages(misaligned, 4, 4, pages, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err,
               "kvb_sglang_slots_to_pages: slots[0] = 2 starts a page but is not a multiple of "
               "page_size 4");
  const int64_t gap[] = {4, 5, 6, 7, 12, 13, 15, 16};
  EXPECT_EQ(kvb_sglang_slots_to_pages(gap, 8, 4, pages, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("slots[6] = 15 breaks the page starting at slots[4] = 12"),
            std::string::npos)
      << g_err;
  const int64_t mixed[] = {-1, 5};
  EXPECT_EQ(kvb_sglang_slots_to_pages(mixed, 2, 2, pages, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("a skipped page must be all negative"), std::string::npos);
  EXPECT_EQ(kvb_sglang_slots_to_pages(gap, 7, 4, pages, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_sglang_slots_to_pages: n_slots (7) is not a whole number of pages of 4");
  EXPECT_EQ(pages[0], -5);  // untouched on failure
  EXPECT_EQ(pages[1], -5);
}

TEST(SelectLayer, BaseAndTableModes) {
  char base[1];
  kvb_page_side s;
  kvb_page_geometry g;
  ASSERT_EQ(kvb_sglang_host_side(&s, &g, KVB_SGLANG_LAYER_FIRST, base, 4, 2, 64, 16, 32, g_err,
                                 sizeof(g_err)),
            KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_side_select_layer(&s, 3, 4, g_err, sizeof(g_err)), KVB_KERNEL_OK);
  EXPECT_EQ(static_cast<char*>(s.base) - base, 3 * 64 * 32);
  std::vector<void*> table(8), device_table(8);
  ASSERT_EQ(kvb_sglang_device_side(&s, &g, table.data(), device_table.data(), 4, 2, 0, 16, 32,
                                   g_err, sizeof(g_err)),
            KVB_KERNEL_OK);
  ASSERT_EQ(kvb_page_side_select_layer(&s, 2, 4, g_err, sizeof(g_err)), KVB_KERNEL_OK);
  EXPECT_EQ(s.layer_ptrs, table.data() + 2);
  EXPECT_EQ(s.layer_ptrs_device, device_table.data() + 2);
  EXPECT_EQ(s.table_kv_stride, 4);  // V of the chosen layer stays 4 entries further
  EXPECT_EQ(kvb_page_side_select_layer(&s, 4, 4, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_page_side_select_layer: layer 4 is outside [0, 4)");
}

kvb_vllm_kv_tensor Tensor(const kvb_test::VllmLayout& l, int64_t elem_bytes) {
  kvb_vllm_kv_tensor t = {};
  t.ndim = static_cast<int>(l.shape.size());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = l.shape[static_cast<size_t>(d)];
    t.strides[d] = l.strides[static_cast<size_t>(d)];
  }
  t.elem_bytes = elem_bytes;
  t.block_dim = l.block_dim;
  t.kv_dim = l.kv_dim;
  t.layer_dim = l.layer_dim;
  return t;
}

const kvb_test::VllmLayout& Layout(const std::string& name) {
  static const std::vector<kvb_test::VllmLayout> all = kvb_test::VllmLayouts();
  for (const auto& l : all) {
    if (l.name == name) return l;
  }
  ADD_FAILURE() << "no layout " << name;
  return all[0];
}

struct VllmExpect {
  int64_t n_layers, n_kv, rows, row_bytes, kv_stride, page_stride, row_stride, num_pages;
};

void ExpectVllm(const std::string& name, const VllmExpect& e) {
  SCOPED_TRACE(name);
  const kvb_vllm_kv_tensor t = Tensor(Layout(name), 2);
  std::vector<void*> table(3, &g_err);
  const bool cross = t.layer_dim >= 0;
  kvb_page_side s;
  kvb_page_geometry g;
  ASSERT_EQ(kvb_vllm_block_side(&s, &g, &t, cross ? &g_err : nullptr,
                                cross ? nullptr : table.data(), nullptr, 3, g_err, sizeof(g_err)),
            KVB_KERNEL_OK)
      << g_err;
  EXPECT_EQ(g.n_layers, e.n_layers);
  EXPECT_EQ(g.n_kv, e.n_kv);
  EXPECT_EQ(g.rows, e.rows);
  EXPECT_EQ(g.row_bytes, e.row_bytes);
  EXPECT_EQ(s.kv_stride_bytes, e.kv_stride);
  EXPECT_EQ(s.page_stride_bytes, e.page_stride);
  EXPECT_EQ(s.row_stride_bytes, e.row_stride);
  EXPECT_EQ(s.num_pages, e.num_pages);
  EXPECT_EQ(s.table_kv_stride, 0);
}

TEST(VllmBlockSide, EachLayoutBecomesRowsOfOneStride) {
  // B = 6 blocks, block_size 16, H = 2, D = 24, bf16: one (block, kv) is 1536 bytes.
  const int64_t blk = 16 * 2 * 24 * 2;
  ExpectVllm("flash_attn_nhd", {3, 2, 1, blk, 6 * blk, blk, blk, 6});
  ExpectVllm("flash_attn_hnd", {3, 2, 1, blk, 6 * blk, blk, blk, 6});
  ExpectVllm("flashinfer_nhd", {3, 2, 1, blk, blk, 2 * blk, blk, 6});
  // K is the first half of every 2 * D row: H x block_size rows of 48 bytes, 96 apart.
  ExpectVllm("packed_kv_hnd", {3, 2, 32, 48, 48, 2 * blk, 96, 6});
  ExpectVllm("mla", {3, 1, 1, 5 * 72 * 2, 0, 5 * 72 * 2, 5 * 72 * 2, 6});
  // 24-element heads 32 apart: block_size x H rows of 48 bytes, 64 apart.
  ExpectVllm("padded_heads_nhd",
             {3, 2, 32, 48, 16 * 2 * 32 * 2, (2 * 16 * 2 * 32 + 40) * 2, 64, 6});
  ExpectVllm("cross_layer_nhd", {3, 2, 1, blk, blk, 3 * 2 * blk, blk, 6});
}

TEST(VllmBlockSide, RefusesWhatIsNotRowsOfOneStride) {
  kvb_vllm_kv_tensor t = {};
  t.ndim = 4;  // (blocks, block_size 4, H 3, D 8): heads 16 apart, tokens 64 apart (not 48)
  const int64_t shape[] = {5, 4, 3, 8}, strides[] = {256, 64, 16, 1};
  for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
  t.elem_bytes = 2;
  t.block_dim = 0;
  t.kv_dim = KVB_KV_DIM_NONE;
  t.layer_dim = KVB_LAYER_DIM_NONE;
  std::vector<void*> table(1, &g_err);
  kvb_page_side s;
  kvb_page_geometry g;
  EXPECT_EQ(
      kvb_vllm_block_side(&s, &g, &t, nullptr, table.data(), nullptr, 1, g_err, sizeof(g_err)),
      KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("not rows of one stride: dimension 1"), std::string::npos)
      << g_err;

  t.strides[2] = 4;  // heads 4 elements apart inside 8-element rows: overlap
  EXPECT_EQ(
      kvb_vllm_block_side(&s, &g, &t, nullptr, table.data(), nullptr, 1, g_err, sizeof(g_err)),
      KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("elements overlap"), std::string::npos) << g_err;

  t.strides[2] = 16;
  t.shape[3] = 7;  // odd last dimension cannot hold K | V
  t.strides[1] = 48;
  t.kv_dim = KVB_KV_DIM_PACKED_LAST;
  EXPECT_EQ(
      kvb_vllm_block_side(&s, &g, &t, nullptr, table.data(), nullptr, 1, g_err, sizeof(g_err)),
      KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("KVB_KV_DIM_PACKED_LAST needs an even last dimension"),
            std::string::npos)
      << g_err;

  t.shape[3] = 8;
  t.kv_dim = 0;
  EXPECT_EQ(
      kvb_vllm_block_side(&s, &g, &t, nullptr, table.data(), nullptr, 1, g_err, sizeof(g_err)),
      KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("must be different"), std::string::npos) << g_err;

  t.kv_dim = KVB_KV_DIM_NONE;
  EXPECT_EQ(kvb_vllm_block_side(&s, &g, &t, nullptr, nullptr, nullptr, 1, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("need layer_ptrs or layer_ptrs_device"), std::string::npos);

  t.layer_dim = 1;
  EXPECT_EQ(kvb_vllm_block_side(&s, &g, &t, &g_err, table.data(), nullptr, 1, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(g_err).find("needs base and no layer tables"), std::string::npos);
}

TEST(PageBufferSide, PageMajorThenLayerThenKv) {
  const kvb_page_geometry g = {3, 2, 16, 100};
  char base;
  kvb_page_side s;
  ASSERT_EQ(kvb_page_buffer_side(&s, &g, &base, 10, g_err, sizeof(g_err)), KVB_KERNEL_OK);
  ExpectSide(s, {1600, 3200, 9600, 100, 10});
  const kvb_page_geometry bad = {3, 0, 16, 100};
  EXPECT_EQ(kvb_page_buffer_side(&s, &bad, &base, 10, g_err, sizeof(g_err)),
            KVB_KERNEL_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(g_err, "kvb_page_buffer_side: geometry->n_kv is 0; it must be >= 1");
}

}  // namespace
