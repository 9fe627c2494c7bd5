// Copyright mstar-kv authors.
//
// The span walk (src/core/span_walk.hpp) and its tables (span_table.hpp):
// the code the cuda_ipc copy kernel runs, run here on the host through the
// kernel's own work split (every block and thread of a grid). Each case
// plans a pull with the planner, copies it once with memcpy, span by span
// and row by row (the reference), and once through the walk, and compares
// every byte of the two caches (bytes no span names keep their sentinel);
// every unit of the table belongs to exactly one (block, thread), and the
// walk covers every byte of the plan exactly once. For every geometry of
// the conformance suite and tests/core/geometry_test.cpp, in every cache
// order the layout accepts (so a new order is covered without a change
// here), with both planners (plan_copies, plan_strided_copies).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/layouts.hpp"
#include "common/strided_spans.hpp"
#include "core/span_table.hpp"
#include "core/span_walk.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

using testing::reference_copy;
using walk::Packing;
using walk::SpanTable;
using walk::WalkStep;
using walk::WalkTable;

constexpr std::byte kSentinel{0xEE};

// Every cache order KVLayout::validate accepts.
std::vector<CacheOrder> cache_orders() {
  std::vector<CacheOrder> out;
  for (unsigned i = 0; i < 16; ++i) {
    KVLayout l = testing::small_layout();
    l.cache_order = static_cast<CacheOrder>(i);
    try {
      l.validate();
    } catch (const Error&) {
      continue;
    }
    out.push_back(l.cache_order);
  }
  return out;
}

std::vector<std::byte> random_bytes(std::uint64_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 g(seed);
  for (std::uint64_t i = 0; i < n; i += 8) {
    const std::uint64_t r = g();
    std::memcpy(v.data() + i, &r, std::min<std::uint64_t>(8, n - i));
  }
  return v;
}

// Every unit of `t` belongs to exactly one (block, thread) of a grid of
// `grid` blocks, and the units' bytes cover every destination byte of the
// spans exactly once (bytes no span names: never).
void expect_exact_cover(const WalkTable& t, std::span<const StridedSpan> spans,
                        std::uint64_t dst_bytes, std::uint64_t grid) {
  std::vector<std::uint8_t> want(dst_bytes, 0);
  std::vector<std::uint8_t> got(dst_bytes, 0);
  for (const StridedSpan& s : spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      for (std::uint64_t b = 0; b < s.length; ++b) ++want[s.local_offset + r * s.local_stride + b];
    }
  }
  std::uint64_t visited = 0;
  for (std::uint64_t b = 0; b < grid; ++b) {
    for (std::uint32_t th = 0; th < walk::kThreads; ++th) {
      walk::for_tile_thread(
          t, b, grid, th,
          [&](const WalkStep& st) {
            ++visited;
            ASSERT_GE(st.bytes, 1u);
            ASSERT_LE(st.bytes, walk::kUnitBytes);
            ASSERT_LE(st.dst + st.bytes, dst_bytes);
            for (std::uint32_t i = 0; i < st.bytes; ++i) ++got[st.dst + i];
          },
          [] {});
    }
  }
  EXPECT_EQ(visited, t.units) << "units visited by the grid's threads";
  for (std::uint64_t k = 0; k < walk::tiles_of(t.units); ++k) {
    ASSERT_EQ(t.tile_first[k], walk::find_span(t.starts, 0, t.count, k * walk::kTileUnits))
        << "tile " << k;
  }
  for (auto c : want) ASSERT_LE(c, 1) << "the plan names a byte twice";
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < dst_bytes; ++i) bad += want[i] != got[i];
  EXPECT_EQ(bad, 0u) << "destination bytes covered other than once per span byte";
}

struct Pull {
  std::string what;
  KVLayout local;
  std::vector<std::pair<KVLayout, std::pair<std::uint32_t, std::uint32_t>>> remotes;
  std::uint64_t start = 0;
  std::uint64_t end = 0;
};

std::vector<std::uint32_t> table_of(std::uint64_t tokens, const KVLayout& l, std::uint64_t seed) {
  std::vector<std::uint32_t> t(l.num_pages);
  std::iota(t.begin(), t.end(), 0u);
  std::mt19937_64 g(seed);
  std::shuffle(t.begin(), t.end(), g);
  t.resize((tokens + l.page_size - 1) / l.page_size);
  return t;
}

// Plans `p` with both planners and checks the walk against the reference
// for grids of 1 and 7 blocks; returns the table entries of the strided plan.
std::uint64_t check_pull(const Pull& p, std::uint64_t grid_big = 7) {
  SCOPED_TRACE(p.what + ": local " + p.local.to_string() + " tokens [" + std::to_string(p.start) +
               ", " + std::to_string(p.end) + ")");
  const std::vector<std::uint32_t> lp = table_of(p.end, p.local, 99);
  std::vector<std::byte> ref(p.local.total_bytes(), kSentinel);
  std::vector<std::byte> by_walk(p.local.total_bytes(), kSentinel);
  std::vector<std::byte> by_flat(p.local.total_bytes(), kSentinel);
  std::vector<std::byte> by_pack(p.local.total_bytes(), kSentinel);
  std::uint64_t entries = 0;
  for (std::size_t i = 0; i < p.remotes.size(); ++i) {
    const KVLayout& rl = p.remotes[i].first;
    const std::vector<std::byte> remote = random_bytes(rl.total_bytes(), 7 + i);
    const auto reads = plan_reads(p.local, rl, p.start, p.end, lp, table_of(p.end, rl, 5 + i),
                                  p.remotes[i].second.first, p.remotes[i].second.second);
    const StridedPlan sp = plan_strided_copies(p.local, rl, reads);
    const CopyPlan cp = plan_copies(p.local, rl, reads);
    reference_copy(sp.spans, remote.data(), ref.data());

    const SpanTable st = walk::make_table(sp.spans);
    EXPECT_EQ(st.size.bytes, sp.total_bytes);
    entries += st.size.entries;
    expect_exact_cover(st.table, sp.spans, p.local.total_bytes(), grid_big);
    walk::copy_on_host(st.table, remote.data(), by_walk.data(), 1);
    // The flat plan through the walk, on a grid of several blocks.
    const SpanTable ft = walk::make_table(cp.spans);
    EXPECT_EQ(ft.size.bytes, cp.total_bytes);
    walk::copy_on_host(ft.table, remote.data(), by_flat.data(), grid_big);
    // Staging: gather the remote rows into a packed buffer, scatter it into
    // the cache (what a staged pull over the wire does), in two halves.
    std::vector<std::byte> packed(sp.total_bytes + 1, std::byte{0});
    const std::size_t half = sp.spans.size() / 2;
    const std::span<const StridedSpan> all(sp.spans);
    std::uint64_t first_half_bytes = 0;
    for (std::size_t k = 0; k < half; ++k) first_half_bytes += all[k].bytes();
    for (auto [part, base] : {std::pair{all.first(half), std::uint64_t{0}},
                              std::pair{all.subspan(half), first_half_bytes}}) {
      const SpanTable g = walk::make_table(part, Packing::kDestination, base);
      walk::copy_on_host(g.table, remote.data(), packed.data(), 3);
      const SpanTable s = walk::make_table(part, Packing::kSource, base);
      walk::copy_on_host(s.table, packed.data(), by_pack.data(), 2);
    }
    EXPECT_EQ(packed.back(), std::byte{0}) << "a gather wrote past the plan's bytes";
  }
  const auto differ = [&](const std::vector<std::byte>& got) {
    std::uint64_t bad = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) bad += got[i] != ref[i];
    return bad;
  };
  EXPECT_EQ(differ(by_walk), 0u) << "strided plan through the walk";
  EXPECT_EQ(differ(by_flat), 0u) << "flat plan through the walk";
  EXPECT_EQ(differ(by_pack), 0u) << "gathered and scattered through packed buffers";
  return entries;
}

KVLayout geo(std::uint32_t page_size, std::uint32_t heads, std::uint32_t first, std::uint32_t total,
             PageOrder po, CacheOrder co, std::uint32_t pages = 40) {
  KVLayout l = testing::make_layout(3, pages, page_size, heads, 4, DType::kBFloat16, co, po);
  l.first_kv_head = first;
  l.total_kv_heads = total;
  return l;
}

using Shard = std::pair<std::uint32_t, std::uint32_t>;
constexpr Shard kAll{0, 0};
constexpr PageOrder kNHD = PageOrder::kNHD;
constexpr PageOrder kHND = PageOrder::kHND;

// geometry_test.cpp's cases, with the local and remote cache orders given.
std::vector<Pull> geometry_cases(CacheOrder lco, CacheOrder rco) {
  std::vector<Pull> v;
  for (std::uint32_t rank : {0u, 1u}) {
    v.push_back({"TP 1 -> 2",
                 geo(16, 4, rank * 4, 8, kNHD, lco),
                 {{geo(16, 8, 0, 8, kNHD, rco), kAll}},
                 0,
                 100});
  }
  v.push_back({"TP 2 -> 1",
               geo(16, 8, 0, 8, kNHD, lco),
               {{geo(16, 4, 0, 8, kNHD, rco), {0, 4}}, {geo(16, 4, 4, 8, kHND, rco), {4, 8}}},
               0,
               100});
  for (std::uint32_t rank : {0u, 5u}) {
    v.push_back({"TP 1 -> 8",
                 geo(16, 1, rank, 8, kHND, lco),
                 {{geo(16, 8, 0, 8, kNHD, rco), kAll}},
                 0,
                 100});
  }
  v.push_back(
      {"TP 2 -> 4", geo(16, 2, 6, 8, kNHD, lco), {{geo(16, 4, 4, 8, kNHD, rco), kAll}}, 0, 100});
  v.push_back({"page sizes, shards, orders at once",
               geo(64, 2, 2, 8, kHND, lco),
               {{geo(16, 4, 0, 8, kNHD, rco, 40), kAll}},
               37,
               300});
  KVLayout mla = geo(16, 1, 0, 1, kNHD, lco);
  mla.has_v = false;
  mla.head_dim = 36;  // 72-byte latent rows: not a multiple of 16
  KVLayout mla_remote = mla;
  mla_remote.page_size = 64;
  mla_remote.cache_order = rco;
  v.push_back({"MLA latent, 64-token remote pages", mla, {{mla_remote, kAll}}, 18, 100});
  for (auto [lps, rps] : {std::pair{16u, 64u}, {64u, 16u}, {16u, 24u}, {24u, 16u}, {7u, 5u}}) {
    for (auto [s, e] : {std::pair<std::uint64_t, std::uint64_t>{0, 250}, {63, 129}, {5, 6}}) {
      v.push_back({"page sizes " + std::to_string(lps) + " <- " + std::to_string(rps),
                   geo(lps, 2, 0, 2, kNHD, lco, 60),
                   {{geo(rps, 2, 0, 2, kHND, rco, 60), kAll}},
                   s,
                   e});
    }
  }
  for (auto lpo : {kNHD, kHND}) {
    for (auto rpo : {kNHD, kHND}) {
      v.push_back({"in-page orders, shard",
                   geo(16, 4, 4, 8, lpo, lco),
                   {{geo(16, 8, 0, 8, rpo, rco), kAll}},
                   20,
                   90});
      v.push_back({"in-page orders",
                   geo(16, 8, 0, 8, lpo, lco),
                   {{geo(16, 8, 0, 8, rpo, rco), kAll}},
                   20,
                   90});
    }
  }
  return v;
}

// The conformance suite's pulls (small_layout: 4 layers, 16-token pages,
// 2 heads x 64 bf16; shard_layout: 32-wide heads).
std::vector<Pull> conformance_cases(CacheOrder lco, CacheOrder rco) {
  using testing::shard_layout;
  using testing::small_layout;
  std::vector<Pull> v;
  v.push_back(
      {"full pull, last page partial", small_layout(lco), {{small_layout(rco), kAll}}, 0, 300});
  v.push_back(
      {"prefix hit mid-page", small_layout(lco, kNHD, 64), {{small_layout(rco), kAll}}, 197, 256});
  v.push_back({"orders differ", small_layout(lco, kHND), {{small_layout(rco, kNHD), kAll}}, 5, 90});
  // The mixed geometries (geometry_cases(), layouts.hpp) in these orders.
  KVLayout owner = testing::geometry_owner();
  owner.cache_order = rco;
  for (testing::GeometryCase c : testing::geometry_cases()) {
    c.local.cache_order = lco;
    v.push_back({c.what, c.local, {{owner, kAll}}, c.start, 300});
  }
  v.push_back({"TP 2 -> 1 from two peers",
               shard_layout(64, 8, 0, 8, kNHD, lco, 16),
               {{shard_layout(16, 4, 0, 8, kNHD, rco, 64), {0, 4}},
                {shard_layout(32, 4, 4, 8, kHND, rco, 32), {4, 8}}},
               0,
               200});
  return v;
}

TEST(SpanWalk, EveryGeometryInEveryCacheOrderByteExact) {
  const auto orders = cache_orders();
  ASSERT_GE(orders.size(), 2u);
  for (CacheOrder lco : orders) {
    for (CacheOrder rco : orders) {
      SCOPED_TRACE("local " + std::string(to_string(lco)) + ", remote " +
                   std::string(to_string(rco)));
      for (const Pull& p : geometry_cases(lco, rco)) check_pull(p);
      for (const Pull& p : conformance_cases(lco, rco)) check_pull(p);
    }
  }
}

// Llama-3-8B's span counts (32 layers, 8 KV heads, 4096 tokens in 256
// scattered 16-token pages: 16,384 spans layer-major), with 8-wide heads so
// that the caches stay small; NHD <- HND (131,072 strided spans) and TP
// 1 -> 2; on the grid the kernel would use on a large GPU (132 SMs x 8).
TEST(SpanWalk, LargestPlansOfTheBenchmarkByteExact) {
  const auto llama = [](CacheOrder co, PageOrder po, std::uint32_t heads, std::uint32_t first) {
    KVLayout l = testing::make_layout(32, 264, 16, heads, 8, DType::kBFloat16, co, po);
    l.total_kv_heads = 8;
    l.first_kv_head = first;
    return l;
  };
  for (CacheOrder co : cache_orders()) {
    const std::uint64_t layer_major_spans = check_pull(
        {"Llama-3-8B shape", llama(co, kNHD, 8, 0), {{llama(co, kNHD, 8, 0), kAll}}, 0, 4096},
        132 * 8);
    if (co == CacheOrder::kLayerMajor) {
      EXPECT_EQ(layer_major_spans, 16384u);
    }
  }
  // The geometry changes once (every order pairing is the first test's).
  const CacheOrder co = CacheOrder::kLayerMajor;
  check_pull({"NHD <- HND", llama(co, kNHD, 8, 0), {{llama(co, kHND, 8, 0), kAll}}, 0, 4096},
             132 * 8);
  check_pull({"TP 1 -> 2", llama(co, kNHD, 4, 4), {{llama(co, kNHD, 8, 0), kAll}}, 0, 4096},
             132 * 8);
}

// Spans of every small length, odd offsets and strides, both base pointers
// at every misalignment: byte-exact, and full aligned units go as vectors.
TEST(SpanWalk, OddLengthsOffsetsStridesAndAlignments) {
  std::mt19937_64 g(3);
  const testing::OddSpans odd = testing::odd_spans(70, 5, g);
  const std::vector<StridedSpan>& spans = odd.spans;
  const std::uint64_t dst_size = odd.dst_end + 64;
  const std::uint64_t src_size = odd.src_end + 64;
  const std::vector<std::byte> source = random_bytes(src_size + 32, 11);
  const SpanTable t = walk::make_table(spans);
  expect_exact_cover(t.table, spans, dst_size, 5);
  for (std::uint64_t sa = 0; sa < 16; sa += 3) {
    for (std::uint64_t da = 0; da < 16; da += 5) {
      std::vector<std::byte> want(dst_size + 32, kSentinel);
      std::vector<std::byte> got(dst_size + 32, kSentinel);
      reference_copy(spans, source.data() + sa, want.data() + da);
      walk::copy_on_host(t.table, source.data() + sa, got.data() + da, 2);
      EXPECT_TRUE(want == got) << "source +" << sa << ", destination +" << da;
    }
  }
  // 16-byte aligned spans of whole units never go narrow; others do.
  const std::vector<StridedSpan> aligned{{0, 64, 4096, 1, 0, 0}, {8192, 16384, 256, 8, 512, 1024}};
  std::vector<std::byte> a(1 << 16, kSentinel);
  std::vector<std::byte> b(1 << 16, kSentinel);
  const std::vector<std::byte> src16 = random_bytes(1 << 16, 5);
  EXPECT_EQ(walk::copy_on_host(walk::make_table(aligned).table, src16.data(), a.data(), 3), 0u);
  reference_copy(aligned, src16.data(), b.data());
  EXPECT_TRUE(a == b);
  EXPECT_GT(walk::copy_on_host(walk::make_table(aligned).table, src16.data() + 4, a.data(), 3), 0u);
  // The width of a unit from the real addresses.
  alignas(16) std::byte buf[64];
  EXPECT_EQ(walk::unit_width(buf, buf + 32, 16), 16u);
  EXPECT_EQ(walk::unit_width(buf + 8, buf + 32, 16), 8u);
  EXPECT_EQ(walk::unit_width(buf, buf + 36, 16), 4u);
  EXPECT_EQ(walk::unit_width(buf, buf + 32, 12), 4u);
  EXPECT_EQ(walk::unit_width(buf, buf + 32, 8), 8u);
  EXPECT_EQ(walk::unit_width(buf + 2, buf + 32, 16), 1u);
  EXPECT_EQ(walk::unit_width(buf, buf + 32, 7), 1u);
}

// Nothing to read: no entry, no unit, nothing touched; spans of no bytes
// are dropped.
TEST(SpanWalk, EmptyPlansWalkNothing) {
  const KVLayout l = testing::small_layout();
  const std::vector<std::uint32_t> pages{3, 4};
  const auto reads = plan_reads(l, l, 32, 32, pages, pages);
  ASSERT_TRUE(reads.empty());
  const StridedPlan sp = plan_strided_copies(l, l, reads);
  const SpanTable t = walk::make_table(sp.spans);
  EXPECT_EQ(t.size.entries, 0u);
  EXPECT_EQ(t.table.units, 0u);
  EXPECT_EQ(t.table.count, 0u);
  std::vector<std::byte> dst(64, kSentinel);
  const std::vector<std::byte> src(64, std::byte{1});
  walk::copy_on_host(t.table, src.data(), dst.data(), 4);
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](std::byte b) { return b == kSentinel; }));
  const std::vector<StridedSpan> nothing{{0, 0, 0, 5, 1, 1}, {8, 8, 4, 0, 0, 0}};
  const SpanTable z = walk::make_table(nothing);
  EXPECT_EQ(z.size.entries, 0u);
  walk::copy_on_host(z.table, src.data(), dst.data(), 1);
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](std::byte b) { return b == kSentinel; }));
}

// Spans past an entry's limits (rows of 2 GiB or more, strides of 4 GiB or
// more, 2^32 rows or more) are split, and every unit still maps where the
// span says, with 64-bit offsets throughout. No memory is touched: the map
// is checked against the span's own arithmetic.
TEST(SpanWalk, SpansPastAnEntrysLimitsSplitAndMapRight) {
  constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
  const std::vector<StridedSpan> spans{
      {5 * kGiB, 7, 3 * kGiB + 5, 1, 0, 0},                            // one 3 GiB row
      {1 << 20, 40 * kGiB, 48, (std::uint64_t{1} << 32) + 3, 64, 96},  // 2^32 + 3 rows
      {1, 2, 100, 3, 5 * kGiB, 6 * kGiB},                              // strides past 4 GiB
      {9, 11, 2 * kGiB + 16, 2, 3 * kGiB, 3 * kGiB},                   // rows past 2 GiB
  };
  const SpanTable t = walk::make_table(spans);
  EXPECT_EQ(t.size.entries, 2u + 2u + 3u + 4u);
  std::uint64_t first = 0;
  std::uint64_t bytes = 0;
  for (const StridedSpan& s : spans) {
    const std::uint64_t per_row = (s.length + 15) / 16;
    bytes += s.bytes();
    // First, last and a few inner units of every row class.
    for (std::uint64_t row : {std::uint64_t{0}, s.rows / 2, s.rows - 1}) {
      for (std::uint64_t chunk : {std::uint64_t{0}, per_row / 2, per_row - 1}) {
        const WalkStep st = walk::locate(t.table, first + row * per_row + chunk);
        EXPECT_EQ(st.dst, s.local_offset + row * s.local_stride + chunk * 16);
        EXPECT_EQ(st.src, s.remote_offset + row * s.remote_stride + chunk * 16);
        EXPECT_EQ(st.bytes, std::min<std::uint64_t>(16, s.length - chunk * 16));
      }
    }
    first += s.rows * per_row;
  }
  EXPECT_EQ(t.table.units, first);
  EXPECT_EQ(t.size.bytes, bytes);
  // walk_units with a stride that jumps over many entries at once agrees
  // with locate (the cursor's far search).
  std::uint64_t n = 0;
  const std::uint64_t stride = t.table.units / 97 + 1;
  walk::walk_units(t.table, 5, t.table.units, stride, [&](const WalkStep& st) {
    const WalkStep want = walk::locate(t.table, 5 + n * stride);
    EXPECT_TRUE(st.dst == want.dst && st.src == want.src && st.bytes == want.bytes)
        << "unit " << 5 + n * stride;
    ++n;
  });
  EXPECT_EQ(n, (t.table.units - 5 + stride - 1) / stride);
}

// Many one-unit spans walked with the kernel's stride: the cursor's far
// jumps (a thread's next unit 256 entries on) land on the right entry.
TEST(SpanWalk, ManyTinySpansOnAWideGrid) {
  std::vector<StridedSpan> spans;
  for (std::uint64_t i = 0; i < 100000; ++i)
    spans.push_back({i * 8, (i * 7919) % 100000 * 8, 3 + i % 5, 1, 0, 0});
  const std::vector<std::byte> src = random_bytes(800064, 2);
  std::vector<std::byte> want(800064, kSentinel);
  std::vector<std::byte> got(800064, kSentinel);
  reference_copy(spans, src.data(), want.data());
  const SpanTable t = walk::make_table(spans);
  expect_exact_cover(t.table, spans, want.size(), 1056);
  walk::copy_on_host(t.table, src.data(), got.data(), 1056);
  EXPECT_TRUE(want == got);
}

}  // namespace
}  // namespace mstar::kv
