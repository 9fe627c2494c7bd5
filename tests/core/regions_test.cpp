// Copyright mstar-kv authors.
//
// Caches of one region per layer (regions.hpp, cache.hpp): the region map,
// the split cache's checks, and the planner's rule that no copy crosses a
// layer boundary of a layer-contiguous cache (so every copy maps whole from
// its first byte), checked against copies made byte by byte.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using testing::iota_pages;
using testing::make_layout;
using testing::shard_layout;
using testing::small_layout;

void expect_error(auto&& fn, StatusCode code, const std::string& needle) {
  testing::expect_error(fn, code, {needle});
}

// Host memory that is a window of a buffer the test owns (to place regions
// where a test wants them, overlapping included).
class Window final : public KVMemory {
 public:
  Window(std::byte* data, std::size_t size, MemoryKind kind = MemoryKind::kHost)
      : data_(data), size_(size), kind_(kind) {}
  std::byte* data() const noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return kind_; }

 private:
  std::byte* data_;
  std::size_t size_;
  MemoryKind kind_;
};

std::vector<std::unique_ptr<KVMemory>> windows(std::vector<std::byte>& buf, std::size_t n,
                                               std::size_t size, std::size_t step) {
  std::vector<std::unique_ptr<KVMemory>> out;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(std::make_unique<Window>(buf.data() + i * step, size));
  return out;
}

TEST(RegionMap, OneRegionAddsTheOffset) {
  const RegionMap m = RegionMap::contiguous(0x1000);
  EXPECT_FALSE(m.split());
  EXPECT_EQ(m.count(), 1u);
  EXPECT_EQ(m.address(0), 0x1000u);
  EXPECT_EQ(m.address(12345), 0x1000u + 12345);
  EXPECT_EQ(m.run_bytes(5, 1u << 30), 1u << 30);
}

TEST(RegionMap, PerLayerMapsEachLayerToItsRegion) {
  const KVLayout l = small_layout();
  const std::uint64_t lb = l.layer_bytes();
  const RegionMap m = RegionMap::per_layer(l, {0x900000, 0x100000, 0x500000, 0x300000});
  EXPECT_TRUE(m.split());
  EXPECT_EQ(m.count(), 4u);
  EXPECT_EQ(m.layer_bytes(), lb);
  EXPECT_EQ(m.address(0), 0x900000u);
  EXPECT_EQ(m.address(lb - 1), 0x900000u + lb - 1);
  EXPECT_EQ(m.address(lb), 0x100000u);
  EXPECT_EQ(m.address(3 * lb + 7), 0x300000u + 7);
  EXPECT_EQ(m.run_bytes(lb - 10, 100), 10u);
  EXPECT_EQ(m.run_bytes(lb, 100), 100u);
  expect_error(
      [&] {
        RegionMap::per_layer(l, {1, 2, 3});
      },
      StatusCode::kInvalidArgument, "needs 4 addresses");
  expect_error(
      [&] {
        RegionMap::per_layer(l, {1, 0, 3, 4});
      },
      StatusCode::kInvalidArgument, "layer 1 is at address 0");
  expect_error(
      [&] {
        RegionMap::per_layer(small_layout(CacheOrder::kPageMajor), {1, 2, 3, 4});
      },
      StatusCode::kInvalidArgument, "contiguous");
}

TEST(RegionMap, DisjointRangesAreCheckedByName) {
  EXPECT_NO_THROW(
      check_disjoint({{"a", 100, 10}, {"b", 110, 10}}, StatusCode::kInvalidArgument, "test"));
  expect_error(
      [] {
        check_disjoint({{"a", 100, 10}, {"b", 105, 10}}, StatusCode::kCorruptDescriptor, "test");
      },
      StatusCode::kCorruptDescriptor, "b [0x69, +10) overlaps a [0x64, +10)");
  expect_error(
      [] {
        check_disjoint({{"a", 0, 10}}, StatusCode::kInvalidArgument, "t");
      },
      StatusCode::kInvalidArgument, "a [0x0, +10) is at address 0");
  expect_error(
      [] {
        check_disjoint({{"a", ~0ull - 4, 10}}, StatusCode::kInvalidArgument, "t");
      },
      StatusCode::kInvalidArgument, "past the end of the address space");
}

TEST(SplitCache, BlocksLiveInTheirLayersRegion) {
  const KVLayout l = small_layout();
  auto c = KVCache::create_host_layers(l);
  EXPECT_TRUE(c->split());
  EXPECT_EQ(c->num_regions(), 4u);
  EXPECT_EQ(c->base(), nullptr);
  for (std::uint32_t layer = 0; layer < 4; ++layer) {
    std::byte* region = c->region_memory(layer).data();
    EXPECT_EQ(c->regions().base(layer), reinterpret_cast<std::uintptr_t>(region));
    EXPECT_EQ(c->block(layer, KV::kKey, 0).data(), region);
    EXPECT_EQ(c->block(layer, KV::kValue, 63).data(), region + l.layer_bytes() - l.block_bytes());
  }
  // A range over three layers comes back as three runs, each in its region.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;
  c->for_each_run(l.layer_bytes() - 5, l.layer_bytes() + 10,
                  [&](std::byte* p, std::uint64_t off, std::uint64_t n) {
                    EXPECT_EQ(p, c->at(off));
                    runs.emplace_back(off, n);
                  });
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0], std::make_pair(l.layer_bytes() - 5, std::uint64_t{5}));
  EXPECT_EQ(runs[1], std::make_pair(l.layer_bytes(), l.layer_bytes()));
  EXPECT_EQ(runs[2], std::make_pair(2 * l.layer_bytes(), std::uint64_t{5}));
}

TEST(SplitCache, RefusesWhatCannotBeOneRegionPerLayer) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 4);
  const std::size_t lb = l.layer_bytes();
  std::vector<std::byte> buf(8 * lb);
  expect_error(
      [&] {
        KVCache(small_layout(CacheOrder::kPageMajor, PageOrder::kNHD, 4), windows(buf, 4, lb, lb));
      },
      StatusCode::kInvalidArgument, "page-major");
  expect_error([&] { KVCache(l, windows(buf, 3, lb, lb)); }, StatusCode::kInvalidArgument,
               "needs 4 memories (the layout's num_layers), got 3");
  expect_error([&] { KVCache(l, windows(buf, 4, lb - 1, lb)); }, StatusCode::kInvalidArgument,
               "layer 0 memory of " + std::to_string(lb - 1) +
                   " bytes is smaller than the layer's " + std::to_string(lb));
  expect_error([&] { KVCache(l, windows(buf, 4, lb, lb / 2)); }, StatusCode::kInvalidArgument,
               "overlaps layer 0");
  auto nulls = windows(buf, 4, lb, lb);
  nulls[2].reset();
  expect_error([&] { KVCache(l, std::move(nulls)); }, StatusCode::kInvalidArgument,
               "layer 2 has no memory");
  auto mixed = windows(buf, 4, lb, lb);
  mixed[3] = std::make_unique<Window>(buf.data() + 5 * lb, lb, MemoryKind::kSharedHost);
  expect_error([&] { KVCache(l, std::move(mixed)); }, StatusCode::kInvalidArgument,
               "layer 3 memory is of kind 1");
  // Regions out of order and apart are fine.
  std::vector<std::unique_ptr<KVMemory>> shuffled;
  for (std::size_t i : {6, 0, 4, 2})
    shuffled.push_back(std::make_unique<Window>(buf.data() + i * lb, lb));
  KVCache ok(l, std::move(shuffled));
  EXPECT_EQ(ok.at(lb), buf.data());
}

// Every copy lies in one layer on each layer-contiguous side.
void expect_no_copy_crosses_a_layer(const KVLayout& local, const KVLayout& remote,
                                    const std::vector<StridedSpan>& spans) {
  const LayerBounds b = LayerBounds::of(local, remote);
  auto same_layer = [](std::uint64_t lb, std::uint64_t first, std::uint64_t last) {
    return lb == 0 || first / lb == last / lb;
  };
  for (const StridedSpan& s : spans) {
    const std::uint64_t llast = s.local_offset + (s.rows - 1) * s.local_stride + s.length - 1;
    const std::uint64_t rlast = s.remote_offset + (s.rows - 1) * s.remote_stride + s.length - 1;
    ASSERT_TRUE(same_layer(b.local, s.local_offset, llast))
        << "local copy [" << s.local_offset << ", " << llast << "] crosses a layer";
    ASSERT_TRUE(same_layer(b.remote, s.remote_offset, rlast))
        << "remote copy [" << s.remote_offset << ", " << rlast << "] crosses a layer";
  }
}

std::vector<StridedSpan> as_strided(const std::vector<CopySpan>& v) {
  std::vector<StridedSpan> out;
  for (const CopySpan& s : v) out.push_back({s.local_offset, s.remote_offset, s.length});
  return out;
}

TEST(PlanLayerFence, ContiguousLayerMajorPullStopsAtEveryLayer) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 8);
  // The whole cache, page i to page i: without the fence one span.
  const CopyPlan plan = plan_copies(l, l, plan_reads(l, 0, 8 * 16, iota_pages(8), iota_pages(8)));
  EXPECT_EQ(plan.spans.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(plan.spans[i], (CopySpan{i * l.layer_bytes(), i * l.layer_bytes(), l.layer_bytes()}));
  }
  EXPECT_EQ(plan.total_bytes, l.total_bytes());
  // Between two page-major caches layers still merge: one span.
  const KVLayout p = small_layout(CacheOrder::kPageMajor, PageOrder::kNHD, 8);
  EXPECT_EQ(plan_copies(p, p, plan_reads(p, 0, 8 * 16, iota_pages(8), iota_pages(8))).spans.size(),
            1u);
}

TEST(PlanLayerFence, NoPlanCrossesALayerOfEitherSide) {
  std::mt19937 rng(7);
  const std::vector<std::pair<KVLayout, KVLayout>> pairs = {
      {small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 8),
       small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 8)},
      {small_layout(CacheOrder::kLayerMajor, PageOrder::kHND, 8),
       small_layout(CacheOrder::kLayerMajor, PageOrder::kHND, 8)},
      {small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 8),
       small_layout(CacheOrder::kPageMajor, PageOrder::kNHD, 8)},
      {small_layout(CacheOrder::kPageMajor, PageOrder::kHND, 8),
       small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 8)},
      {shard_layout(16, 2, 0, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 8),
       shard_layout(16, 2, 0, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 8)},
      {shard_layout(16, 1, 1, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 8),
       shard_layout(16, 2, 0, 2, PageOrder::kHND, CacheOrder::kLayerMajor, 8)},
      {shard_layout(32, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerMajor, 4),
       shard_layout(16, 2, 0, 2, PageOrder::kNHD, CacheOrder::kLayerMajor, 8)},
  };
  for (const auto& [local, remote] : pairs) {
    SCOPED_TRACE(local.to_string() + " <- " + remote.to_string());
    for (int round = 0; round < 20; ++round) {
      const std::uint64_t tokens =
          std::min(local.num_pages * local.page_size, remote.num_pages * remote.page_size);
      // Identity tables at first (the case that merges the most), then shuffled.
      std::vector<std::uint32_t> lp = iota_pages(local.num_pages);
      std::vector<std::uint32_t> rp = iota_pages(remote.num_pages);
      if (round > 0) {
        std::shuffle(lp.begin(), lp.end(), rng);
        std::shuffle(rp.begin(), rp.end(), rng);
      }
      const std::uint64_t start = round % 3 == 2 ? 5 : 0;
      const auto reads = plan_reads(local, remote, start, tokens, lp, rp);
      const CopyPlan flat = plan_copies(local, remote, reads);
      expect_no_copy_crosses_a_layer(local, remote, as_strided(flat.spans));
      const StridedPlan strided = plan_strided_copies(local, remote, reads);
      expect_no_copy_crosses_a_layer(local, remote, strided.spans);
      EXPECT_EQ(strided.total_bytes, flat.total_bytes);
      const auto rows = strided_rows(strided.spans, LayerBounds::of(local, remote));
      expect_no_copy_crosses_a_layer(local, remote, as_strided(rows));
    }
  }
}

TEST(PlanLayerFence, StridedRowsMergeAcrossALayerOnlyWithoutBounds) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 2);
  const std::uint64_t lb = l.layer_bytes();
  // Two strided spans whose rows touch at the layer boundary on both sides.
  const std::vector<StridedSpan> spans = {{lb - 64, lb - 64, 32, 2, 32, 32},
                                          {lb, lb, 32, 2, 32, 32}};
  EXPECT_EQ(strided_rows(spans).size(), 1u);
  const auto fenced = strided_rows(spans, LayerBounds::of(l, l));
  ASSERT_EQ(fenced.size(), 2u);
  EXPECT_EQ(fenced[0], (CopySpan{lb - 64, lb - 64, 64}));
  EXPECT_EQ(fenced[1], (CopySpan{lb, lb, 64}));
}

// Copies a plan between two split caches through their region maps, one
// address per copy, and checks the result byte for byte.
TEST(PlanLayerFence, SplitCachesCopyByteExactThroughTheirRegions) {
  for (auto [lo, ro] :
       {std::pair{PageOrder::kNHD, PageOrder::kNHD}, std::pair{PageOrder::kHND, PageOrder::kNHD}}) {
    const KVLayout local = small_layout(CacheOrder::kLayerMajor, lo, 16);
    const KVLayout remote = small_layout(CacheOrder::kLayerMajor, ro, 12);
    auto src = KVCache::create_host_layers(remote);
    auto dst = KVCache::create_host_layers(local);
    const std::vector<std::uint32_t> rp = {11, 3, 4, 5, 0, 9};
    const std::vector<std::uint32_t> lp = {0, 15, 14, 1, 2, 3};
    fill_pattern(*src, 99, rp, 0, 90);
    const auto reads = plan_reads(local, remote, 3, 90, lp, rp);
    const StridedPlan plan = plan_strided_copies(local, remote, reads);
    for (const StridedSpan& s : plan.spans) {
      std::byte* d = dst->at(s.local_offset);
      const std::byte* r = src->at(s.remote_offset);
      for (std::uint64_t i = 0; i < s.rows; ++i) {
        std::memcpy(d + i * s.local_stride, r + i * s.remote_stride, s.length);
      }
    }
    const VerifyResult v = verify_pattern(*dst, 99, lp, 3, 90);
    EXPECT_TRUE(v.ok()) << v.mismatched_blocks << " blocks differ";
    // Nothing but those tokens was written: the first 3 tokens stay zero.
    EXPECT_EQ(dst->block(0, KV::kKey, 0)[0], std::byte{0});
  }
}

}  // namespace
}  // namespace mstar::kv
