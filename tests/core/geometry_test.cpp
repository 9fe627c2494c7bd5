// Copyright mstar-kv authors.
//
// Caches of different geometry: tensor-parallel head splits and
// merges, MLA, page sizes that differ (also ones that do not divide each
// other), NHD <-> HND and every pair of cache orders (layer, page,
// layer_page), prefix hits mid-page. Each
// case plans with plan_reads(local, remote, ...) + plan_copies, applies the
// spans with memcpy between two host buffers, and compares every byte with
// a reference computed per (layer, k|v, token, head) by a plain loop; bytes
// the read does not name keep their sentinel.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/layouts.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

constexpr std::uint8_t kSentinel = 0xEE;
constexpr CacheOrder kOrders[] = {CacheOrder::kLayerMajor, CacheOrder::kPageMajor,
                                  CacheOrder::kLayerPage};

// fn(local in-page order, remote in-page order, local cache order, remote
// cache order) for every combination.
template <typename Fn>
void for_every_order(Fn&& fn) {
  for (auto lpo : {PageOrder::kNHD, PageOrder::kHND}) {
    for (auto rpo : {PageOrder::kNHD, PageOrder::kHND}) {
      for (CacheOrder lco : kOrders) {
        for (CacheOrder rco : kOrders) fn(lpo, rpo, lco, rco);
      }
    }
  }
}

KVLayout geo(std::uint32_t page_size, std::uint32_t heads, std::uint32_t first, std::uint32_t total,
             PageOrder po = PageOrder::kNHD, CacheOrder co = CacheOrder::kLayerMajor,
             std::uint32_t pages = 40) {
  KVLayout l = testing::make_layout(3, pages, page_size, heads, 4, DType::kBFloat16, co, po);
  l.first_kv_head = first;
  l.total_kv_heads = total;
  return l;
}

// The byte of element d of (layer, kv, token position p, model head h): a
// function of all five, so any misplaced row shows.
std::uint8_t value(std::uint32_t layer, std::uint32_t kv, std::uint64_t p, std::uint32_t h,
                   std::uint32_t byte) {
  return static_cast<std::uint8_t>((layer * 131 + kv * 71 + p * 29 + h * 17 + byte * 5 + 1) % 251);
}

std::vector<std::uint32_t> table(std::uint32_t n, std::uint32_t num_pages, std::uint64_t seed) {
  std::vector<std::uint32_t> t(num_pages);
  std::iota(t.begin(), t.end(), 0u);
  std::mt19937_64 g(seed);
  std::shuffle(t.begin(), t.end(), g);
  t.resize(n);
  return t;
}

struct Side {
  KVLayout layout;
  std::vector<std::uint32_t> pages;  // page table in its own page size
  std::vector<std::uint8_t> bytes;
};

// A remote cache whose every (layer, kv, token, head) of the sequence holds
// value(); the rest of it is 0.
Side remote_side(const KVLayout& l, std::uint64_t tokens, std::uint64_t seed) {
  Side s{l,
         table(static_cast<std::uint32_t>((tokens + l.page_size - 1) / l.page_size), l.num_pages,
               seed),
         std::vector<std::uint8_t>(l.total_bytes(), 0)};
  const std::uint64_t hb = l.head_bytes();
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
      for (std::uint64_t p = 0; p < tokens; ++p) {
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          const std::uint64_t off =
              l.block_offset(layer, static_cast<KV>(kv), s.pages[p / l.page_size]) +
              l.in_block_offset(static_cast<std::uint32_t>(p % l.page_size), h);
          for (std::uint32_t b = 0; b < hb; ++b) {
            s.bytes[off + b] = value(layer, kv, p, l.first_kv_head + h, b);
          }
        }
      }
    }
  }
  return s;
}

void apply(const StridedPlan& plan, const Side& remote, Side& local) {
  for (const StridedSpan& c : plan.spans) {
    for (std::uint64_t i = 0; i < c.rows; ++i) {
      const std::uint64_t lo = c.local_offset + i * c.local_stride;
      const std::uint64_t ro = c.remote_offset + i * c.remote_stride;
      ASSERT_LE(ro + c.length, remote.bytes.size());
      ASSERT_LE(lo + c.length, local.bytes.size());
      std::memcpy(local.bytes.data() + lo, remote.bytes.data() + ro, c.length);
    }
  }
}

// Which planner a check uses: plan_copies (flat spans) or
// plan_strided_copies; every check runs with both.
bool g_strided = false;

void apply(const CopyPlan& plan, const Side& remote, Side& local) {
  for (const CopySpan& c : plan.spans) {
    ASSERT_LE(c.remote_offset + c.length, remote.bytes.size());
    ASSERT_LE(c.local_offset + c.length, local.bytes.size());
    std::memcpy(local.bytes.data() + c.local_offset, remote.bytes.data() + c.remote_offset,
                c.length);
  }
}

// Pulls tokens [start, end) into `local` from `remotes`, each supplying the
// heads [lo, hi) given with it, then checks every byte of the local cache.
void check_pull(const KVLayout& local_layout, std::uint64_t start, std::uint64_t end,
                const std::vector<std::pair<KVLayout, std::pair<std::uint32_t, std::uint32_t>>>& rs,
                std::uint64_t* spans_out = nullptr) {
  Side local{
      local_layout,
      table(static_cast<std::uint32_t>((end + local_layout.page_size - 1) / local_layout.page_size),
            local_layout.num_pages, 99),
      std::vector<std::uint8_t>(local_layout.total_bytes(), kSentinel)};
  std::uint64_t spans = 0;
  for (std::size_t i = 0; i < rs.size(); ++i) {
    const Side remote = remote_side(rs[i].first, end, 7 + i);
    const auto reads = plan_reads(local.layout, remote.layout, start, end, local.pages,
                                  remote.pages, rs[i].second.first, rs[i].second.second);
    if (g_strided) {
      const StridedPlan plan = plan_strided_copies(local.layout, remote.layout, reads);
      const CopyPlan flat = plan_copies(local.layout, remote.layout, reads);
      EXPECT_EQ(plan.total_bytes, flat.total_bytes);
      EXPECT_LE(plan.spans.size(), flat.spans.size());
      spans += plan.spans.size();
      // What an engine without a strided form posts: the rows, the same bytes.
      const std::vector<CopySpan> rows = strided_rows(plan.spans);
      EXPECT_LE(rows.size(), flat.spans.size());
      Side by_rows = local;
      apply(CopyPlan{rows, plan.total_bytes, 0}, remote, by_rows);
      apply(plan, remote, local);
      EXPECT_TRUE(by_rows.bytes == local.bytes) << "strided_rows moved other bytes";
    } else {
      const CopyPlan plan = plan_copies(local.layout, remote.layout, reads);
      spans += plan.spans.size();
      apply(plan, remote, local);
    }
  }
  if (spans_out) *spans_out = spans;
  // Expected: sentinel everywhere but the named tokens of every local head.
  const KVLayout& l = local.layout;
  std::vector<std::uint8_t> want(l.total_bytes(), kSentinel);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
      for (std::uint64_t p = start; p < end; ++p) {
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          const std::uint64_t off =
              l.block_offset(layer, static_cast<KV>(kv), local.pages[p / l.page_size]) +
              l.in_block_offset(static_cast<std::uint32_t>(p % l.page_size), h);
          for (std::uint32_t b = 0; b < l.head_bytes(); ++b) {
            want[off + b] = value(layer, kv, p, l.first_kv_head + h, b);
          }
        }
      }
    }
  }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) bad += want[i] != local.bytes[i];
  EXPECT_EQ(bad, 0u) << "bytes differ from the per-(token, head) reference: local "
                     << l.to_string();
}

using Shard = std::pair<std::uint32_t, std::uint32_t>;
constexpr Shard kAll{0, 0};

TEST(Geometry, TensorParallelSplitsAndMerges) {
  // TP 1 -> 2: each decode rank reads its half of one prefill cache.
  for (std::uint32_t rank : {0u, 1u}) {
    check_pull(geo(16, 4, rank * 4, 8), 0, 100, {{geo(16, 8, 0, 8), kAll}});
  }
  // TP 2 -> 1: one decode cache from two prefill peers, each its heads.
  check_pull(geo(16, 8, 0, 8), 0, 100, {{geo(16, 4, 0, 8), {0, 4}}, {geo(16, 4, 4, 8), {4, 8}}});
  // TP 1 -> 8 and 8 -> 1.
  for (std::uint32_t rank = 0; rank < 8; ++rank) {
    check_pull(geo(16, 1, rank, 8), 0, 100, {{geo(16, 8, 0, 8), kAll}});
  }
  std::vector<std::pair<KVLayout, Shard>> eight;
  for (std::uint32_t r = 0; r < 8; ++r) eight.push_back({geo(16, 1, r, 8), {r, r + 1}});
  check_pull(geo(16, 8, 0, 8), 0, 100, eight);
  // TP 2 -> 4: decode rank 3 holds heads 6-7, inside prefill rank 1's 4-7.
  check_pull(geo(16, 2, 6, 8), 0, 100, {{geo(16, 4, 4, 8), kAll}});
  // And with other page sizes and orders at once.
  check_pull(geo(64, 2, 2, 8, PageOrder::kHND), 37, 300,
             {{geo(16, 4, 0, 8, PageOrder::kNHD, CacheOrder::kPageMajor, 40), kAll}});
  // Upstream mstar's [L, P, 2, T, H, D] on both sides of a split and a merge.
  check_pull(geo(32, 2, 2, 8, PageOrder::kNHD, CacheOrder::kLayerPage), 5, 200,
             {{geo(16, 8, 0, 8, PageOrder::kHND, CacheOrder::kLayerPage, 40), kAll}});
  check_pull(geo(16, 8, 0, 8, PageOrder::kHND, CacheOrder::kLayerPage), 0, 100,
             {{geo(16, 4, 0, 8, PageOrder::kNHD, CacheOrder::kLayerPage), {0, 4}},
              {geo(32, 4, 4, 8, PageOrder::kHND, CacheOrder::kPageMajor), {4, 8}}});
}

TEST(Geometry, LatentCacheIsPulledWholeFromAnyPeer) {
  KVLayout mla = geo(16, 1, 0, 1);
  mla.has_v = false;
  mla.head_dim = 36;  // 72-byte latent rows
  KVLayout remote = mla;
  remote.page_size = 64;
  check_pull(mla, 0, 100, {{remote, kAll}});
  check_pull(mla, 18, 100, {{mla, kAll}});
  // Without V, layer_page is layer-major byte for byte; either reads the other.
  for (CacheOrder lco : kOrders) {
    for (CacheOrder rco : kOrders) {
      KVLayout l = mla, r = remote;
      l.cache_order = lco;
      r.cache_order = rco;
      check_pull(l, 7, 100, {{r, kAll}});
      r.page_size = l.page_size;
      check_pull(l, 0, 96, {{r, kAll}});
    }
  }
}

TEST(Geometry, PageSizesThatDifferMapTokensByPosition) {
  const std::pair<std::uint32_t, std::uint32_t> pairs[] = {{16, 64}, {64, 16}, {16, 128}, {128, 16},
                                                           {16, 24}, {24, 16}, {7, 5}};
  for (auto [lps, rps] : pairs) {
    for (auto [start, end] :
         {std::pair<std::uint64_t, std::uint64_t>{0, 250}, {20, 250}, {63, 129}, {5, 6}}) {
      SCOPED_TRACE(std::to_string(lps) + " <- " + std::to_string(rps) + " tokens [" +
                   std::to_string(start) + ", " + std::to_string(end) + ")");
      check_pull(geo(lps, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerMajor, 60), start, end,
                 {{geo(rps, 2, 0, 2, PageOrder::kHND, CacheOrder::kPageMajor, 60), kAll}});
      check_pull(geo(lps, 2, 0, 2, PageOrder::kHND, CacheOrder::kPageMajor, 60), start, end,
                 {{geo(rps, 2, 0, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 60), kAll}});
      check_pull(geo(lps, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerPage, 60), start, end,
                 {{geo(rps, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerMajor, 60), kAll}});
      check_pull(geo(lps, 2, 0, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 60), start, end,
                 {{geo(rps, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerPage, 60), kAll}});
    }
  }
}

TEST(Geometry, InPageAndCacheOrdersInEveryCombination) {
  for_every_order([](PageOrder lpo, PageOrder rpo, CacheOrder lco, CacheOrder rco) {
    // Prefix hit mid-page: tokens [20, 90).
    check_pull(geo(16, 4, 4, 8, lpo, lco), 20, 90, {{geo(16, 8, 0, 8, rpo, rco), kAll}});
    check_pull(geo(16, 8, 0, 8, lpo, lco), 20, 90, {{geo(16, 8, 0, 8, rpo, rco), kAll}});
    // Page sizes that differ, and a whole sequence of full pages.
    check_pull(geo(32, 8, 0, 8, lpo, lco), 3, 150, {{geo(8, 8, 0, 8, rpo, rco), kAll}});
    check_pull(geo(16, 8, 0, 8, lpo, lco), 0, 160, {{geo(16, 8, 0, 8, rpo, rco), kAll}});
  });
}

// Every case above again, planned with plan_strided_copies.
TEST(Geometry, StridedPlansMoveTheSameBytes) {
  g_strided = true;
  for (std::uint32_t rank : {0u, 1u}) {
    check_pull(geo(16, 4, rank * 4, 8), 0, 100, {{geo(16, 8, 0, 8), kAll}});
  }
  check_pull(geo(16, 8, 0, 8), 0, 100, {{geo(16, 4, 0, 8), {0, 4}}, {geo(16, 4, 4, 8), {4, 8}}});
  check_pull(geo(64, 2, 2, 8, PageOrder::kHND), 37, 300,
             {{geo(16, 4, 0, 8, PageOrder::kNHD, CacheOrder::kPageMajor, 40), kAll}});
  for_every_order([](PageOrder lpo, PageOrder rpo, CacheOrder lco, CacheOrder rco) {
    check_pull(geo(16, 4, 4, 8, lpo, lco), 20, 90, {{geo(16, 8, 0, 8, rpo, rco), kAll}});
    check_pull(geo(16, 8, 0, 8, lpo, lco), 20, 90, {{geo(24, 8, 0, 8, rpo, rco), kAll}});
    check_pull(geo(16, 8, 0, 8, lpo, lco), 0, 96, {{geo(16, 8, 0, 8, rpo, rco), kAll}});
  });
  // NHD <- HND, one geometry: one strided span per (page, layer, k|v, head)
  // instead of one per (token, head) row.
  std::uint64_t spans = 0;
  check_pull(geo(16, 8, 0, 8, PageOrder::kNHD), 0, 160, {{geo(16, 8, 0, 8, PageOrder::kHND), kAll}},
             &spans);
  EXPECT_EQ(spans, 10u * 3 * 2 * 8);
  // TP 1 -> 2 over NHD: one per (page, layer, k|v).
  check_pull(geo(16, 4, 4, 8), 0, 160, {{geo(16, 8, 0, 8), kAll}}, &spans);
  EXPECT_EQ(spans, 10u * 3 * 2);
  g_strided = false;
}

TEST(Geometry, HeadSplitInTheSameOrderIsOneSpanPerTokenRunNotPerRow) {
  // TP 1 -> 2 over HND pages: a head's tokens are contiguous on both sides.
  std::uint64_t spans = 0;
  check_pull(geo(16, 4, 4, 8, PageOrder::kHND), 0, 160, {{geo(16, 8, 0, 8, PageOrder::kHND), kAll}},
             &spans);
  EXPECT_LE(spans, 3u * 2 * 10 * 1) << "expected one span per (layer, k|v, page): heads 4-7 "
                                       "are adjacent in both pages";
}

TEST(Geometry, CombinationsThatCannotWorkAreRefusedNamingTheField) {
  auto refused = [](const KVLayout& local, const KVLayout& remote, StatusCode code,
                    const std::string& needle, Shard heads = kAll) {
    const std::vector<std::uint32_t> lp(20, 0), rp(20, 0);
    try {
      auto reads = plan_reads(local, remote, 0, 16, lp, rp, heads.first, heads.second);
      (void)plan_copies(local, remote, reads);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // A shard that does not cover the local heads.
  refused(geo(16, 4, 0, 8), geo(16, 4, 4, 8), StatusCode::kIncompatibleLayout,
          "the remote cache holds KV heads [4, 8) of 8, the read needs [0, 4)");
  // Another model's head count.
  refused(geo(16, 4, 0, 8), geo(16, 16, 0, 16), StatusCode::kIncompatibleLayout, "total_kv_heads");
  KVLayout other = geo(16, 8, 0, 8);
  other.head_dim = 8;
  refused(geo(16, 8, 0, 8), other, StatusCode::kIncompatibleLayout, "head_dim");
  other = geo(16, 8, 0, 8);
  other.dtype = DType::kFloat16;
  refused(geo(16, 8, 0, 8), other, StatusCode::kIncompatibleLayout, "dtype");
  other = geo(16, 8, 0, 8);
  other.num_layers = 4;
  refused(geo(16, 8, 0, 8), other, StatusCode::kIncompatibleLayout, "num_layers");
  other = geo(16, 1, 0, 1);
  other.has_v = false;
  refused(geo(16, 1, 0, 1), other, StatusCode::kIncompatibleLayout, "has_v");
  // Heads to read outside the local cache's own.
  refused(geo(16, 4, 0, 8), geo(16, 8, 0, 8), StatusCode::kInvalidArgument,
          "not a part of the local cache's heads", {2, 6});
  // A layout whose shard does not fit its model.
  EXPECT_THROW(geo(16, 4, 6, 8).validate(), Error);
}

TEST(Geometry, ReadsThatFillOnePageTwiceAreRefused) {
  const KVLayout local = geo(64, 2, 0, 2), remote = geo(16, 2, 0, 2);
  std::vector<KVReadInfo> reads{{0, 1, 3, 0, 16, 0}, {0, 1, 4, 8, 24, 0}};
  try {
    (void)plan_copies(local, remote, reads);
    FAIL() << "overlapping tokens of one local page accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate destination"), std::string::npos) << e.what();
  }
  reads[1].token_start = 16;  // adjacent, not overlapping: fine
  reads[1].token_end = 32;
  EXPECT_NO_THROW((void)plan_copies(local, remote, reads));
}

}  // namespace
}  // namespace mstar::kv
