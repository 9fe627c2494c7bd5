// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

KVLayout layout(CacheOrder co, PageOrder po, std::uint32_t pages = 16) {
  return testing::make_layout(3, pages, 4, 2, 8, DType::kFloat16, co, po);
}

std::vector<std::uint32_t> iota(std::uint32_t n, std::uint32_t from = 0) {
  std::vector<std::uint32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

using testing::expect_error;

TEST(PlanReads, ClipsFirstAndLastPage) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  const auto lp = iota(3, 10);
  const auto rp = iota(3, 5);
  auto reads = plan_reads(l, 2, 9, lp, rp);  // tokens [2,9): pages 0,1,2
  ASSERT_EQ(reads.size(), 9u);               // 3 pages x 3 layers
  // Layer-major: layer outer, page inner.
  EXPECT_EQ(reads[0], (KVReadInfo{0, 10, 5, 2, 4}));
  EXPECT_EQ(reads[1], (KVReadInfo{0, 11, 6, 0, 4}));
  EXPECT_EQ(reads[2], (KVReadInfo{0, 12, 7, 0, 1}));
  EXPECT_EQ(reads[3], (KVReadInfo{1, 10, 5, 2, 4}));
}

// The reads come in the cache's order: pages outer for page-major, layers
// outer for layer-page (layer-major: ClipsFirstAndLastPage).
TEST(PlanReads, ReadsComeInTheCacheOrder) {
  const std::vector<KVReadInfo> pages_outer = {{0, 0, 0, 0, 4}, {1, 0, 0, 0, 4}, {2, 0, 0, 0, 4},
                                               {0, 1, 1, 0, 4}, {1, 1, 1, 0, 4}, {2, 1, 1, 0, 4}};
  const std::vector<KVReadInfo> layers_outer = {{0, 0, 0, 0, 4}, {0, 1, 1, 0, 4}, {1, 0, 0, 0, 4},
                                                {1, 1, 1, 0, 4}, {2, 0, 0, 0, 4}, {2, 1, 1, 0, 4}};
  for (const auto& [co, want] : {std::pair{CacheOrder::kPageMajor, pages_outer},
                                 std::pair{CacheOrder::kLayerPage, layers_outer}}) {
    SCOPED_TRACE(to_string(co));
    EXPECT_EQ(plan_reads(layout(co, PageOrder::kNHD), 0, 8, iota(2), iota(2)), want);
  }
}

TEST(PlanReads, PrefixHitPullsOnlyTheTail) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  // 20 tokens, the first 13 cached: only pages 3 ([13,16)) and 4 ([16,20)).
  auto reads = plan_reads(l, 13, 20, iota(5), iota(5, 8));
  ASSERT_EQ(reads.size(), 6u);
  EXPECT_EQ(reads[0], (KVReadInfo{0, 3, 11, 1, 4}));
  EXPECT_EQ(reads[1], (KVReadInfo{0, 4, 12, 0, 4}));
  // A prefix that ends on a page boundary skips that page entirely.
  reads = plan_reads(l, 16, 20, iota(5), iota(5));
  ASSERT_EQ(reads.size(), 3u);
  EXPECT_EQ(reads[0], (KVReadInfo{0, 4, 4, 0, 4}));
}

TEST(PlanReads, EmptyRangeIsNoWorkButIsValidated) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  EXPECT_TRUE(plan_reads(l, 0, 0, {}, {}).empty());
  EXPECT_TRUE(plan_reads(l, 7, 7, iota(2), iota(2)).empty());
  // The same checks as a non-empty range: the tables must cover
  // end_len, and the entry holding a mid-page start_len must be in range.
  expect_error([&] { plan_reads(l, 7, 7, {}, {}); }, StatusCode::kInvalidArgument,
               {"local page table has 0 entries, tokens [7, 7) need 2"});
  expect_error([&] { plan_reads(l, 7, 7, iota(2), iota(1)); }, StatusCode::kInvalidArgument,
               {"remote page table has 1 entries"});
  std::vector<std::uint32_t> bad = iota(2);
  bad[1] = 1000;
  expect_error([&] { plan_reads(l, 7, 7, bad, iota(2)); }, StatusCode::kInvalidArgument,
               {"local page 1000 (table entry 1) out of range"});
}

TEST(PlanReads, RejectsBadArguments) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  expect_error([&] { plan_reads(l, 9, 2, iota(3), iota(3)); }, StatusCode::kInvalidArgument,
               {"start_len 9 is greater than end_len 2"});
  expect_error([&] { plan_reads(l, 0, 9, iota(2), iota(3)); }, StatusCode::kInvalidArgument,
               {"local page table has 2 entries"});
  expect_error([&] { plan_reads(l, 0, 9, iota(3), iota(2)); }, StatusCode::kInvalidArgument,
               {"remote page table has 2 entries"});
  std::vector<std::uint32_t> bad = {0, 16, 2};
  expect_error([&] { plan_reads(l, 0, 9, bad, iota(3)); }, StatusCode::kInvalidArgument,
               {"local page 16 (table entry 1) out of range [0, 16)"});
  // A local page named twice: the table entries, not "read N".
  std::vector<std::uint32_t> twice = {5, 7, 5};
  expect_error([&] { plan_reads(l, 0, 9, twice, iota(3)); }, StatusCode::kInvalidArgument,
               {"local page 5 appears twice in the local page table (entries 0 and 2)"});
  // Entries outside the range are not read, so not checked.
  EXPECT_NO_THROW(plan_reads(l, 4, 9, twice, iota(3)));
}

// The remote side of a pull, checked by the caller's table entries.
TEST(CheckRemotePages, NamesTheTableEntryAndPage) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  KVLayout r = l;
  r.num_pages = 8;
  std::vector<std::uint32_t> remote = {0, 1, 8, 3};
  expect_error([&] { check_remote_pages(l, r, 0, 16, remote); }, StatusCode::kInvalidArgument,
               {"remote page 8 (table entry 2) out of range [0, 8) in remote cache"});
  // Page size 4: tokens [12, 16) touch entry 3 only; [8, 8) (aligned) none.
  EXPECT_NO_THROW(check_remote_pages(l, r, 12, 16, remote));
  EXPECT_NO_THROW(check_remote_pages(l, r, 8, 8, remote));
  expect_error([&] { check_remote_pages(l, r, 9, 9, remote); }, StatusCode::kInvalidArgument,
               {"(table entry 2)"});
  r.head_dim = 16;
  expect_error([&] { check_remote_pages(l, r, 0, 4, remote); }, StatusCode::kIncompatibleLayout,
               {"head_dim"});
}

TEST(PlanCopies, RejectsEveryBadRead) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  struct Bad {
    std::uint32_t remote_page_size;  // of the remote cache (8 pages); l has 4
    KVReadInfo read;
    const char* says;
  };
  const Bad bad[] = {
      {4, {3, 0, 0, 0, 4}, "layer 3 out of range [0, 3)"},
      {4, {-1, 0, 0, 0, 4}, "layer -1"},
      {4, {0, 16, 0, 0, 4}, "local page 16 out of range [0, 16)"},
      {4, {0, 0, 8, 0, 4}, "read_info[0]: remote page 8 out of range [0, 8) in remote cache"},
      {4, {0, 0, 0, 2, 2}, "token range [2, 2)"},
      {4, {0, 0, 0, 0, 5}, "<= 4"},
      {4, {0, 0, 0, -1, 3}, "token range [-1, 3)"},
      // Page sizes may differ (tokens map by position), but the remote
      // tokens must fit in the remote page.
      {2, {0, 0, 0, 0, 4}, "do not fit in a remote page of 2 tokens"},
      {2, {0, 0, 0, 0, 2, /*remote_token_start=*/1}, "remote tokens [1, 3)"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.says);
    KVLayout r = l;
    r.num_pages = 8;
    r.page_size = b.remote_page_size;
    const std::vector<KVReadInfo> one{b.read};
    expect_error([&] { plan_copies(l, r, one); }, StatusCode::kInvalidArgument, {b.says});
  }
  KVLayout r = l;
  r.num_pages = 8;
  std::vector<KVReadInfo> dup{{1, 2, 0, 0, 2}, {1, 2, 1, 2, 4}};
  expect_error([&] { plan_copies(l, r, dup); }, StatusCode::kInvalidArgument,
               {"read_info[1]: duplicate destination: layer 1 local page 2"});
  r.head_dim = l.head_dim * 2;
  const std::vector<KVReadInfo> whole{{0, 0, 0, 0, 4}};
  expect_error([&] { plan_copies(l, r, whole); }, StatusCode::kIncompatibleLayout, {"head_dim"});
}

TEST(PlanCopies, SameLayerTwoPagesIsNotADuplicate) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  std::vector<KVReadInfo> v{{1, 2, 0, 0, 4}, {2, 2, 0, 0, 4}, {1, 3, 0, 0, 4}};
  EXPECT_NO_THROW(plan_copies(l, l, v));
}

TEST(PlanCopies, PageMajorContiguousRequestIsOneCopy) {
  const KVLayout l = layout(CacheOrder::kPageMajor, PageOrder::kNHD);
  auto reads = plan_reads(l, 0, 32, iota(8, 2), iota(8, 5));
  auto plan = plan_copies(l, l, reads);
  ASSERT_EQ(plan.spans.size(), 1u);
  EXPECT_EQ(plan.uncoalesced_spans, 8u * 3 * 2);
  EXPECT_EQ(plan.total_bytes, 8 * l.page_bytes_all_layers());
  EXPECT_EQ(plan.spans[0], (CopySpan{2 * l.page_bytes_all_layers(), 5 * l.page_bytes_all_layers(),
                                     8 * l.page_bytes_all_layers()}));
}

TEST(PlanCopies, LayerMajorContiguousIsOneCopyPerLayerAndKv) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  auto plan = plan_copies(l, l, plan_reads(l, 0, 32, iota(8), iota(8, 8)));
  EXPECT_EQ(plan.spans.size(), 3u * 2);
}

// [layer][page][k|v]: K and V of a page are neighbours, and so are the
// pages of a layer: a contiguous table is one copy per layer, and so is a
// whole cache (no copy crosses a layer boundary: a layer may be its own
// region, regions.hpp).
TEST(PlanCopies, LayerPageContiguousIsOneCopyPerLayer) {
  const KVLayout l = layout(CacheOrder::kLayerPage, PageOrder::kNHD);
  auto plan = plan_copies(l, l, plan_reads(l, 0, 32, iota(8, 2), iota(8, 5)));
  ASSERT_EQ(plan.spans.size(), 3u);
  EXPECT_EQ(plan.uncoalesced_spans, 8u * 3 * 2);
  for (std::uint32_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(plan.spans[layer],
              (CopySpan{l.block_offset(layer, KV::kKey, 2), l.block_offset(layer, KV::kKey, 5),
                        8 * 2 * l.block_bytes()}));
  }
  auto whole = plan_copies(l, l, plan_reads(l, 0, 64, iota(16), iota(16)));
  ASSERT_EQ(whole.spans.size(), 3u);
  for (std::uint32_t layer = 0; layer < 3; ++layer) {
    const std::uint64_t at = layer * l.layer_bytes();
    EXPECT_EQ(whole.spans[layer], (CopySpan{at, at, l.layer_bytes()}));
  }
  // Scattered pages: one copy per (layer, page), K and V together.
  std::vector<std::uint32_t> lp = {7, 3, 12, 0};
  std::vector<std::uint32_t> rp = {1, 9, 4, 15};
  auto scattered = plan_copies(l, l, plan_reads(l, 0, 16, lp, rp));
  ASSERT_EQ(scattered.spans.size(), 4u * 3);
  EXPECT_EQ(scattered.spans[0], (CopySpan{l.block_offset(0, KV::kKey, 7),
                                          l.block_offset(0, KV::kKey, 1), 2 * l.block_bytes()}));
}

// Without V the order is layer-major's bytes: a whole cache is one copy per
// layer between the two.
TEST(PlanCopies, LatentLayerPageAndLayerMajorAreTheSameBytes) {
  KVLayout lp = layout(CacheOrder::kLayerPage, PageOrder::kNHD);
  lp.has_v = false;
  KVLayout lm = lp;
  lm.cache_order = CacheOrder::kLayerMajor;
  for (auto [a, b] : {std::pair{lp, lm}, std::pair{lm, lp}}) {
    auto plan = plan_copies(a, b, plan_reads(a, 0, 64, iota(16), iota(16)));
    ASSERT_EQ(plan.spans.size(), 3u) << a.to_string() << " <- " << b.to_string();
    for (std::uint32_t layer = 0; layer < 3; ++layer) {
      const std::uint64_t at = layer * lp.layer_bytes();
      EXPECT_EQ(plan.spans[layer], (CopySpan{at, at, lp.layer_bytes()}));
    }
  }
}

// Several remote pages filling one local layer_page page: the K runs of the
// page go first, then its V runs, so that they merge where the remote's
// pages are neighbours too (layer-major's K blocks of a layer are).
TEST(PlanCopies, LayerPageFilledFromSmallerPagesMergesItsKAndVRuns) {
  const KVLayout local = layout(CacheOrder::kLayerPage, PageOrder::kNHD);  // 4-token pages
  KVLayout remote = local;
  remote.page_size = 2;
  remote.num_pages = 32;
  remote.cache_order = CacheOrder::kLayerMajor;
  const std::vector<std::uint32_t> lp{9}, rp{6, 7};
  auto plan = plan_copies(local, remote, plan_reads(local, remote, 0, 4, lp, rp));
  ASSERT_EQ(plan.spans.size(), 3u * 2);  // per layer: its K run, its V run
  EXPECT_EQ(plan.total_bytes, 3u * 2 * local.block_bytes());
  EXPECT_EQ(plan.spans[0], (CopySpan{local.block_offset(0, KV::kKey, 9),
                                     remote.block_offset(0, KV::kKey, 6), local.block_bytes()}));
  EXPECT_EQ(plan.spans[1], (CopySpan{local.block_offset(0, KV::kValue, 9),
                                     remote.block_offset(0, KV::kValue, 6), local.block_bytes()}));
}

TEST(PlanCopies, ScatteredPagesAreOneCopyPerBlock) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  std::vector<std::uint32_t> lp = {7, 3, 12, 0};
  std::vector<std::uint32_t> rp = {1, 9, 4, 15};
  auto plan = plan_copies(l, l, plan_reads(l, 0, 16, lp, rp));
  EXPECT_EQ(plan.spans.size(), 4u * 3 * 2);
  EXPECT_EQ(plan.uncoalesced_spans, plan.spans.size());
}

TEST(PlanCopies, PartialHndPageIsOneSpanPerHead) {
  const KVLayout l = layout(CacheOrder::kLayerMajor, PageOrder::kHND);
  std::vector<KVReadInfo> v{{0, 1, 1, 1, 3}};
  auto plan = plan_copies(l, l, v);
  ASSERT_EQ(plan.spans.size(), 2u * 2);  // 2 heads x (k, v)
  const std::uint64_t kb = l.block_offset(0, KV::kKey, 1);
  EXPECT_EQ(plan.spans[0], (CopySpan{kb + 1 * 16, kb + 1 * 16, 2 * 16}));
  EXPECT_EQ(plan.spans[1], (CopySpan{kb + 5 * 16, kb + 5 * 16, 2 * 16}));
  EXPECT_EQ(plan.total_bytes, 2u * 2 * 2 * 16);
  // The same partial page in NHD is one span per block.
  const KVLayout n = layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  EXPECT_EQ(plan_copies(n, n, v).spans.size(), 2u);
}

TEST(PlanCopies, SplitSpansKeepsEveryByte) {
  std::vector<CopySpan> in{{0, 100, 10}, {50, 0, 3}};
  auto out = split_spans(in, 4);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0], (CopySpan{0, 100, 4}));
  EXPECT_EQ(out[2], (CopySpan{8, 108, 2}));
  EXPECT_EQ(out[3], (CopySpan{50, 0, 3}));
}

// Moves real bytes between two host caches through the planner, for every
// combination of orders, and checks every byte: the pulled tokens match the
// pattern, everything else in the destination is still zero.
class CopyThroughPlanner
    : public ::testing::TestWithParam<std::tuple<CacheOrder, PageOrder, CacheOrder, PageOrder>> {};

TEST_P(CopyThroughPlanner, MovesExactlyTheNamedTokens) {
  auto [lco, lpo, rco, rpo] = GetParam();
  const KVLayout ll = layout(lco, lpo, 16);
  const KVLayout rl = layout(rco, rpo, 12);
  auto local = KVCache::create_host(ll);
  auto remote = KVCache::create_host(rl);
  const std::vector<std::uint32_t> rp = {11, 2, 7, 3, 0, 9};
  const std::vector<std::uint32_t> lp = {5, 6, 1, 14, 15, 8};
  const std::uint64_t tokens = 22;  // last page partial
  fill_pattern(*remote, 42, rp, 0, tokens);
  const std::uint64_t start = 5;  // prefix hit inside page 1
  auto plan = plan_copies(ll, rl, plan_reads(ll, start, tokens, lp, rp));
  for (const CopySpan& s : plan.spans) {
    std::memcpy(local->base() + s.local_offset, remote->base() + s.remote_offset, s.length);
  }
  EXPECT_EQ(plan.total_bytes, (tokens - start) * ll.token_bytes() * 2 * ll.num_layers);
  auto v = verify_pattern(*local, 42, lp, start, tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  EXPECT_EQ(v.bytes_checked, plan.total_bytes);
  // The cached prefix [0, start) was not written: it is still zero, so its
  // pattern check must fail on every block of page 0 and page 1.
  auto prefix = verify_pattern(*local, 42, lp, 0, start);
  EXPECT_EQ(prefix.mismatched_blocks, prefix.blocks_checked);
  // Count bytes that differ from zero: exactly the pulled bytes (the pattern
  // has no zero 8-byte words in practice; check per byte is too strict).
  std::uint64_t nonzero_rows = 0;
  const std::byte* p = local->base();
  for (std::uint64_t off = 0; off < ll.total_bytes(); off += ll.head_bytes()) {
    bool any = false;
    for (std::uint64_t j = 0; j < ll.head_bytes(); ++j) any |= p[off + j] != std::byte{0};
    nonzero_rows += any;
  }
  EXPECT_EQ(nonzero_rows * ll.head_bytes(), plan.total_bytes);
}

// "layer_page_nhd_from_page_hnd".
std::string orders_name(
    const ::testing::TestParamInfo<std::tuple<CacheOrder, PageOrder, CacheOrder, PageOrder>>& p) {
  const auto& [lco, lpo, rco, rpo] = p.param;
  return std::string(to_string(lco)) + "_" + std::string(to_string(lpo)) + "_from_" +
         std::string(to_string(rco)) + "_" + std::string(to_string(rpo));
}

INSTANTIATE_TEST_SUITE_P(
    AllOrders, CopyThroughPlanner,
    ::testing::Combine(
        ::testing::Values(CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage),
        ::testing::Values(PageOrder::kNHD, PageOrder::kHND),
        ::testing::Values(CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage),
        ::testing::Values(PageOrder::kNHD, PageOrder::kHND)),
    orders_name);

}  // namespace
}  // namespace mstar::kv
