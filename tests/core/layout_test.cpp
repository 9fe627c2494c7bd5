// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <array>
#include <type_traits>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/util/status.hpp"

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

TEST(KVLayout, LayerPageOffsetsHandComputed) {
  const KVLayout l = small(CacheOrder::kLayerPage, PageOrder::kNHD);
  // [layer][page][k|v]: ((1*4 + 2)*2 + 1) * 128
  EXPECT_EQ(l.block_offset(1, KV::kValue, 2), 1664u);
  EXPECT_EQ(l.block_offset(0, KV::kValue, 0), 128u);  // V right after K of its page
  EXPECT_EQ(l.block_offset(0, KV::kKey, 1), 256u);    // the next page after them
  EXPECT_EQ(l.block_offset(1, KV::kKey, 0), 1024u);   // the next layer after all pages
}

// Every (layer, k|v, page, token, head) row lies where the 6-D view
// (view_shape, C-contiguous) puts it, for every order; the rows tile the
// cache exactly once.
TEST(KVLayout, OffsetsAreTheViewShapesContiguousIndex) {
  for (auto co : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage}) {
    for (auto po : {PageOrder::kNHD, PageOrder::kHND}) {
      for (bool has_v : {true, false}) {
        const KVLayout l = small(co, po, has_v);
        SCOPED_TRACE(l.to_string());
        const auto shape = l.view_shape();
        std::uint64_t numel = 1;
        for (auto d : shape) numel *= d;
        ASSERT_EQ(numel * l.element_size(), l.total_bytes());
        std::vector<int> seen(l.total_bytes() / l.head_bytes(), 0);
        for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
          for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
            for (std::uint32_t page = 0; page < l.num_pages; ++page) {
              for (std::uint32_t t = 0; t < l.page_size; ++t) {
                for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
                  const std::uint64_t p0 = po == PageOrder::kNHD ? t : h;
                  const std::uint64_t p1 = po == PageOrder::kNHD ? h : t;
                  std::array<std::uint64_t, 3> outer{};
                  switch (co) {
                    case CacheOrder::kLayerMajor:
                      outer = {layer, kv, page};
                      break;
                    case CacheOrder::kPageMajor:
                      outer = {page, layer, kv};
                      break;
                    case CacheOrder::kLayerPage:
                      outer = {layer, page, kv};
                      break;
                  }
                  const std::array<std::uint64_t, 6> idx{outer[0], outer[1], outer[2], p0, p1, 0};
                  std::uint64_t flat = 0;
                  for (std::size_t d = 0; d < 6; ++d) flat = flat * shape[d] + idx[d];
                  const std::uint64_t off =
                      l.block_offset(layer, static_cast<KV>(kv), page) + l.in_block_offset(t, h);
                  ASSERT_EQ(off, flat * l.element_size());
                  ++seen[off / l.head_bytes()];
                }
              }
            }
          }
        }
        for (int n : seen) ASSERT_EQ(n, 1);
      }
    }
  }
}

TEST(KVLayout, ViewShapesAndAxes) {
  using S = std::array<std::uint64_t, 6>;
  EXPECT_EQ(small(CacheOrder::kLayerMajor, PageOrder::kNHD).view_shape(), (S{2, 2, 4, 4, 2, 8}));
  EXPECT_EQ(small(CacheOrder::kPageMajor, PageOrder::kNHD).view_shape(), (S{4, 2, 2, 4, 2, 8}));
  EXPECT_EQ(small(CacheOrder::kLayerPage, PageOrder::kNHD).view_shape(), (S{2, 4, 2, 4, 2, 8}));
  EXPECT_EQ(small(CacheOrder::kLayerPage, PageOrder::kHND).view_shape(), (S{2, 4, 2, 2, 4, 8}));
  EXPECT_EQ(small(CacheOrder::kLayerPage, PageOrder::kHND, false).view_shape(),
            (S{2, 4, 1, 2, 4, 8}));
  EXPECT_EQ(small(CacheOrder::kLayerPage, PageOrder::kHND).view_axes(),
            "[num_layers, num_pages, num_kv, num_kv_heads, page_size, head_dim]");
  EXPECT_EQ(small(CacheOrder::kLayerMajor, PageOrder::kNHD).view_axes(),
            "[num_layers, num_kv, num_pages, page_size, num_kv_heads, head_dim]");
}

// Without V, [layer][page][k] and [layer][k][page] are the same bytes; the
// order stays what the owner declared.
TEST(KVLayout, LayerPageWithoutVIsLayerMajorByteForByte) {
  const KVLayout lp = small(CacheOrder::kLayerPage, PageOrder::kNHD, false);
  const KVLayout lm = small(CacheOrder::kLayerMajor, PageOrder::kNHD, false);
  for (std::uint32_t layer = 0; layer < lp.num_layers; ++layer) {
    for (std::uint32_t page = 0; page < lp.num_pages; ++page) {
      EXPECT_EQ(lp.block_offset(layer, KV::kKey, page), lm.block_offset(layer, KV::kKey, page));
    }
  }
  EXPECT_NE(lp, lm);
  EXPECT_EQ(lp.cache_order, CacheOrder::kLayerPage);
  EXPECT_NE(lp.to_string(), lm.to_string());
}

TEST(KVLayout, CacheOrderNames) {
  for (auto co : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage}) {
    EXPECT_EQ(parse_cache_order(to_string(co)), co);
  }
  EXPECT_EQ(to_string(CacheOrder::kLayerPage), "layer_page");
  EXPECT_EQ(small(CacheOrder::kLayerPage, PageOrder::kHND).to_string(),
            "2L x 4P x 4T x 2H x 8D fp16 kv layer-page-major hnd");
  testing::expect_error([] { parse_cache_order("layer-page"); }, StatusCode::kInvalidArgument,
                        {"unknown cache order 'layer-page'", "layer, page or layer_page"});
}

TEST(KVLayout, ValidateRefusesOrdersOutOfRange) {
  KVLayout l = small(CacheOrder::kLayerPage, PageOrder::kNHD);
  EXPECT_NO_THROW(l.validate());
  l.cache_order = static_cast<CacheOrder>(3);
  testing::expect_error([&] { l.validate(); }, StatusCode::kInvalidArgument,
                        {"cache_order 3 out of range [0, 2]"});
  l = small(CacheOrder::kLayerPage, PageOrder::kNHD);
  l.page_order = static_cast<PageOrder>(2);
  testing::expect_error([&] { l.validate(); }, StatusCode::kInvalidArgument,
                        {"page_order 2 out of range [0, 1]"});
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
