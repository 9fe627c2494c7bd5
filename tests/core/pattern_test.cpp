// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <cstring>

#include "common/layouts.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

// 3 heads of 5 fp16: 10-byte rows exercise the partial-word tail.
KVLayout layout(CacheOrder co, PageOrder po) {
  return testing::make_layout(2, 8, 4, 3, 5, DType::kFloat16, co, po);
}

TEST(Pattern, FillThenVerify) {
  auto c = KVCache::create_host(layout(CacheOrder::kPageMajor, PageOrder::kHND));
  const std::vector<std::uint32_t> pages = {3, 1, 6};
  fill_pattern(*c, 9, pages, 0, 11);
  auto v = verify_pattern(*c, 9, pages, 0, 11);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  EXPECT_EQ(v.blocks_checked, 3u * 2 * 2);
  EXPECT_EQ(v.bytes_checked, 11u * 30 * 2 * 2);
  EXPECT_FALSE(verify_pattern(*c, 10, pages, 0, 11).ok());  // other seed
}

TEST(Pattern, IsIndependentOfPhysicalPlacementAndOrder) {
  auto a = KVCache::create_host(layout(CacheOrder::kLayerMajor, PageOrder::kNHD));
  auto b = KVCache::create_host(layout(CacheOrder::kPageMajor, PageOrder::kHND));
  const std::vector<std::uint32_t> pa = {0, 1, 2};
  const std::vector<std::uint32_t> pb = {7, 5, 4};
  fill_pattern(*a, 1, pa, 0, 12);
  fill_pattern(*b, 1, pb, 0, 12);
  auto va = verify_pattern(*a, 1, pa, 0, 12);
  auto vb = verify_pattern(*b, 1, pb, 0, 12);
  EXPECT_TRUE(va.ok() && vb.ok());
  EXPECT_EQ(va.checksum, vb.checksum);
  // And a layer_page cache: the same rows, where that order puts them (the
  // V row of token 5, head 2 of layer 1 right after its page's K block).
  auto c = KVCache::create_host(layout(CacheOrder::kLayerPage, PageOrder::kNHD));
  const std::vector<std::uint32_t> pc = {6, 2, 3};
  fill_pattern(*c, 1, pc, 0, 12);
  auto vc = verify_pattern(*c, 1, pc, 0, 12);
  EXPECT_TRUE(vc.ok()) << vc.first_mismatch;
  EXPECT_EQ(vc.checksum, va.checksum);
  const KVLayout& l = c->layout();
  const std::uint64_t v_row =
      (1u * 8 + 2) * 2 * l.block_bytes() + l.block_bytes() + l.in_block_offset(1, 2);
  EXPECT_EQ(std::memcmp(c->base() + v_row,
                        a->base() + a->layout().block_offset(1, KV::kValue, 1) +
                            a->layout().in_block_offset(1, 2),
                        l.head_bytes()),
            0);
}

TEST(Pattern, OneFlippedByteIsFoundAndNamed) {
  auto c = KVCache::create_host(layout(CacheOrder::kLayerMajor, PageOrder::kNHD));
  const std::vector<std::uint32_t> pages = {2, 5};
  fill_pattern(*c, 3, pages, 0, 8);
  c->block(1, KV::kValue, 5)[7] ^= std::byte{1};
  auto v = verify_pattern(*c, 3, pages, 0, 8);
  EXPECT_EQ(v.mismatched_blocks, 1u);
  EXPECT_NE(v.first_mismatch.find("layer 1 v page 5 (sequence page 1"), std::string::npos)
      << v.first_mismatch;
}

TEST(Pattern, RejectsShortTables) {
  auto c = KVCache::create_host(layout(CacheOrder::kLayerMajor, PageOrder::kNHD));
  const std::vector<std::uint32_t> pages = {2};
  EXPECT_THROW(fill_pattern(*c, 3, pages, 0, 8), Error);
  const std::vector<std::uint32_t> oob = {8};
  EXPECT_THROW(verify_pattern(*c, 3, oob, 0, 4), Error);
}

}  // namespace
}  // namespace mstar::kv
