// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <type_traits>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/status.hpp"
#include "common/layouts.hpp"

namespace mstar::kv {
namespace {

// 2 layers, 4 pages of 4 tokens, 2 heads of 8 fp16: head 16 B, token 32 B,
// block 128 B.
KVLayout small(CacheOrder co, PageOrder po, bool has_v = true) {
  KVLayout l = testing::make_layout(2, 4, 4, 2, 8, DType::kFloat16, co, po);
  l.has_v = has_v;
  return l;
}

TEST(KVLayout, SizesFollowGeometry) {
  const KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  EXPECT_EQ(l.head_bytes(), 16u);
  EXPECT_EQ(l.token_bytes(), 32u);
  EXPECT_EQ(l.block_bytes(), 128u);
  EXPECT_EQ(l.total_bytes(), 128u * 2 * 2 * 4);
  EXPECT_EQ(small(CacheOrder::kLayerMajor, PageOrder::kNHD, false).total_bytes(), 128u * 2 * 4);
}

TEST(KVLayout, DtypeSizes) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kFloat8E5M2), 1u);
  EXPECT_EQ(parse_dtype("fp8_e5m2"), DType::kFloat8E5M2);
  EXPECT_THROW(parse_dtype("int4"), Error);
}

TEST(KVLayout, LayerMajorOffsetsHandComputed) {
  const KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  // [layer][k|v][page]: ((1*2 + 1)*4 + 2) * 128
  EXPECT_EQ(l.block_offset(1, KV::kValue, 2), 1792u);
  EXPECT_EQ(l.block_offset(0, KV::kValue, 0), 512u);
  EXPECT_EQ(l.block_offset(1, KV::kKey, 0), 1024u);
}

TEST(KVLayout, PageMajorOffsetsHandComputed) {
  const KVLayout l = small(CacheOrder::kPageMajor, PageOrder::kNHD);
  // [page][layer][k|v]: ((2*2 + 1)*2 + 1) * 128
  EXPECT_EQ(l.block_offset(1, KV::kValue, 2), 1408u);
  EXPECT_EQ(l.block_offset(0, KV::kKey, 1), 512u);
}

TEST(KVLayout, MlaHasNoValueBlock) {
  const KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD, false);
  EXPECT_EQ(l.num_kv(), 1u);
  EXPECT_EQ(l.block_offset(1, KV::kKey, 2), ((1u * 1 + 0) * 4 + 2) * 128);
  auto cache = KVCache::create_host(l);
  EXPECT_THROW(cache->block(0, KV::kValue, 0), Error);
}

TEST(KVLayout, InPageOffsetsHandComputed) {
  const KVLayout nhd = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  const KVLayout hnd = small(CacheOrder::kLayerMajor, PageOrder::kHND);
  EXPECT_EQ(nhd.in_block_offset(1, 1), (1u * 2 + 1) * 16);  // [token][head]
  EXPECT_EQ(hnd.in_block_offset(1, 1), (1u * 4 + 1) * 16);  // [head][token]
  EXPECT_EQ(nhd.in_block_offset(3, 0), 96u);
  EXPECT_EQ(hnd.in_block_offset(3, 0), 48u);
}

TEST(KVLayout, ValidateNamesTheField) {
  KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  l.page_size = 0;
  try {
    l.validate();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("page_size 0"), std::string::npos) << e.what();
  }
  l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  l.num_pages = LayoutLimits::kMaxPages;
  l.num_layers = LayoutLimits::kMaxLayers;
  l.head_dim = LayoutLimits::kMaxHeadDim;
  EXPECT_THROW(l.validate(), Error);  // total size over the limit
}

TEST(KVLayout, CompatibilityNamesTheDifferingField) {
  const KVLayout a = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  KVLayout b = small(CacheOrder::kPageMajor, PageOrder::kHND);
  b.num_pages = 99;
  EXPECT_TRUE(a.is_compatible(b));  // orders and page counts may differ
  EXPECT_NO_THROW(a.check_compatible(b));
  b.head_dim = 16;
  EXPECT_FALSE(a.is_compatible(b));
  try {
    a.check_compatible(b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kIncompatibleLayout);
    EXPECT_NE(std::string(e.what()).find("head_dim: local 8, remote 16"), std::string::npos)
        << e.what();
  }
  b = a;
  b.dtype = DType::kBFloat16;
  try {
    a.check_compatible(b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype: local fp16, remote bf16"), std::string::npos);
  }
  b = a;
  b.has_v = false;
  EXPECT_THROW(a.check_compatible(b), Error);
}

// The header's contract: engines and pools keep a cache's address, so it is
// shared (std::shared_ptr), never copied or moved.
static_assert(!std::is_copy_constructible_v<KVCache> && !std::is_move_constructible_v<KVCache> &&
              !std::is_copy_assignable_v<KVCache> && !std::is_move_assignable_v<KVCache>);

TEST(KVCache, BlockViewsAreBoundsChecked) {
  const KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  auto cache = KVCache::create_host(l);
  auto b = cache->block(1, KV::kValue, 2);
  EXPECT_EQ(b.data(), cache->base() + 1792);
  EXPECT_EQ(b.size(), 128u);
  try {
    cache->block(0, KV::kKey, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("page 4 out of range [0, 4)"), std::string::npos);
  }
  EXPECT_THROW(cache->block(2, KV::kKey, 0), Error);
}

TEST(KVCache, RejectsMemorySmallerThanLayout) {
  const KVLayout l = small(CacheOrder::kLayerMajor, PageOrder::kNHD);
  EXPECT_THROW(KVCache(l, allocate_host_memory(l.total_bytes() - 1)), Error);
}

}  // namespace
}  // namespace mstar::kv
