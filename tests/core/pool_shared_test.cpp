// Copyright mstar-kv authors.
//
// KVCachePool's shared pages (adopt with allow_shared): holder counts,
// epochs that name content, readiness that never goes backwards, refused
// calls that change nothing. The pulls over a real engine are in
// shared_pages_test.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

std::shared_ptr<KVCache> cache(std::uint32_t pages) {
  return KVCache::create_host(testing::make_layout(4, pages, 16, 1, 8));
}

// What a reader of the cache sees of a page.
struct Seen {
  std::uint64_t epoch;
  std::uint32_t ready;
  bool operator==(const Seen&) const = default;
};
Seen seen(const KVCache& c, std::uint32_t p) { return {c.epochs().load(p), c.readiness().load(p)}; }

TEST(KVCachePoolShared, SharedPagesCountHoldersAndKeepTheirEpoch) {
  auto c = cache(8);
  KVCachePool pool(c, KVTransferInfo{"shm", {1}, 0});
  pool.adopt(1, 32, std::vector<std::uint32_t>{3, 5});
  const std::uint64_t ea = c->epochs().load(3);
  // Without allow_shared a held page is still refused.
  EXPECT_THROW(pool.adopt(2, 48, std::vector<std::uint32_t>{3, 5, 0}), Error);
  pool.adopt(2, 48, std::vector<std::uint32_t>{3, 5, 0}, true);
  const std::uint64_t eb = c->epochs().load(0);
  EXPECT_NE(eb, ea);
  EXPECT_EQ(c->epochs().load(3), ea);
  EXPECT_EQ(c->epochs().load(5), ea);
  EXPECT_EQ(pool.holders(3), 2u);
  EXPECT_EQ(pool.holders(0), 1u);
  EXPECT_EQ(pool.holders(7), 0u);
  EXPECT_EQ(pool.free_page_count(), 5u);
  // A third holder of one of them, allocated sequences are shareable too.
  const auto d = pool.allocate(4, 16);
  pool.adopt(3, 32, std::vector<std::uint32_t>{5, d[0]}, true);
  EXPECT_EQ(pool.holders(5), 3u);
  EXPECT_EQ(pool.holders(d[0]), 2u);

  const SequenceInfo b = pool.publish(2);
  EXPECT_EQ(b.kv_transfer_info.epoch, eb);
  EXPECT_EQ(b.kv_transfer_info.page_epochs, (std::vector<PageEpoch>{{3, ea}, {5, ea}}));
  const SequenceInfo s3 = pool.publish(3);
  EXPECT_EQ(s3.kv_transfer_info.page_epochs.size(), 2u);  // 5 of seq 1, d[0] of seq 4

  // free_pages of a shared page is refused; release drops one hold.
  EXPECT_THROW(pool.free_pages(std::vector<std::uint32_t>{3}), Error);
  pool.release(1);
  EXPECT_EQ(pool.holders(3), 1u);
  EXPECT_EQ(c->epochs().load(3), ea);
  EXPECT_EQ(pool.free_page_count(), 4u);  // 3 and 5 still held: nothing freed
  // done of the sequence's own epoch, not the shared pages'.
  EXPECT_FALSE(pool.done(2, ea));
  EXPECT_TRUE(pool.done(2, eb));
  EXPECT_EQ(c->epochs().load(3), 0u);
  EXPECT_EQ(c->epochs().load(0), 0u);
  EXPECT_EQ(c->epochs().load(5), ea);  // seq 3 still holds it
  EXPECT_EQ(pool.free_page_count(), 6u);
  pool.release(3);
  pool.release(4);
  EXPECT_EQ(pool.free_page_count(), 8u);
  for (std::uint32_t p = 0; p < 8; ++p) EXPECT_EQ(pool.holders(p), 0u) << p;
  // Freed pages are reusable, with a fresh epoch.
  pool.adopt(5, 16, std::vector<std::uint32_t>{3});
  EXPECT_NE(c->epochs().load(3), 0u);
  EXPECT_NE(c->epochs().load(3), ea);
}

TEST(KVCachePoolShared, ALeaseExpiryDropsOnlyItsHold) {
  auto c = cache(4);
  KVCachePool pool(c, KVTransferInfo{"shm", {1}, 0}, 0, std::chrono::milliseconds(20));
  pool.adopt(1, 16, std::vector<std::uint32_t>{2});
  const std::uint64_t ea = c->epochs().load(2);
  pool.adopt(2, 32, std::vector<std::uint32_t>{2, 1}, true);
  pool.publish(1);  // leased; 2 is not published, so never expires
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  EXPECT_EQ(pool.expire_leases(), 1u);
  EXPECT_EQ(pool.holders(2), 1u);
  EXPECT_EQ(c->epochs().load(2), ea);
  EXPECT_EQ(pool.free_page_count(), 2u);
}

// A shared page was written and marked by its first holder: a new holder
// neither resets it nor lowers it by marking fewer layers of its own.
TEST(KVCachePoolShared, ReadinessOfASharedPageNeverGoesBackwards) {
  auto c = cache(8);
  KVCachePool pool(c, KVTransferInfo{"shm", {1}, 0});
  pool.adopt(1, 32, std::vector<std::uint32_t>{1, 2});
  pool.publish(1, 0);
  pool.mark_layers_ready(1, 3);
  EXPECT_EQ(c->readiness().load(1), 3u);
  pool.adopt(2, 48, std::vector<std::uint32_t>{1, 2, 4}, true);
  EXPECT_EQ(c->readiness().load(1), 3u);
  EXPECT_EQ(c->readiness().load(4), 0u);
  pool.publish(2, 1);
  EXPECT_EQ(c->readiness().load(1), 3u);
  EXPECT_EQ(c->readiness().load(4), 1u);
  pool.mark_layers_ready(2, 2);
  EXPECT_EQ(c->readiness().load(2), 3u);
  EXPECT_EQ(c->readiness().load(4), 2u);
  pool.mark_layers_ready(2, 4);  // raises the shared pages too
  EXPECT_EQ(c->readiness().load(1), 4u);
  pool.mark_layers_ready(1, 3);  // seq 1's own count: a no-op, not a lowering
  EXPECT_EQ(c->readiness().load(1), 4u);
  EXPECT_EQ(pool.layers_ready(1), 3u);
}

TEST(KVCachePoolShared, ARefusedSharedAdoptChangesNothing) {
  auto c = cache(8);
  KVCachePool pool(c, KVTransferInfo{"shm", {1}, 0});
  pool.adopt(1, 32, std::vector<std::uint32_t>{3, 5});
  pool.publish(1, 2);
  const auto loose = pool.allocate_pages(1);  // page 0
  struct Case {
    std::vector<std::uint32_t> pages;
    const char* says;
  };
  // Each fails after a shared page and a free page were taken in, so the
  // undo of both is checked.
  const Case cases[] = {
      {{3, 6, 3}, "page 3 is named twice"},
      {{3, 6, 6}, "page 6 is named twice"},
      {{3, 6, 8}, "page 8 out of range [0, 8)"},
      {{3, 6, loose[0]}, "page 0 is held (allocate_pages)"},
  };
  std::vector<Seen> before;
  for (std::uint32_t p = 0; p < 8; ++p) before.push_back(seen(*c, p));
  for (const Case& k : cases) {
    testing::expect_error([&] { pool.adopt(2, 48, k.pages, true); }, StatusCode::kInvalidArgument,
                          {k.says});
    EXPECT_FALSE(pool.contains(2));
    EXPECT_EQ(pool.free_page_count(), 5u);
    EXPECT_EQ(pool.holders(3), 1u);
    EXPECT_EQ(pool.holders(6), 0u);
    for (std::uint32_t p = 0; p < 8; ++p) EXPECT_EQ(seen(*c, p), before[p]) << p;
  }
  // Without allow_shared, a held page is refused.
  testing::expect_error(
      [&] {
        pool.adopt(2, 32, std::vector<std::uint32_t>{3, 6});
      },
      StatusCode::kInvalidArgument, {"page 3 is held by a live sequence"});
  EXPECT_THROW(pool.holders(8), Error);
  // The marks were undone: the same pages are taken now, 3 shared, 6 free.
  pool.adopt(2, 32, std::vector<std::uint32_t>{3, 6}, true);
  EXPECT_EQ(pool.holders(3), 2u);
  EXPECT_EQ(pool.holders(6), 1u);
  EXPECT_EQ(pool.free_page_count(), 4u);
}

// An epoch the caller chose (vLLM's scheduler names it in a request's params
// before the worker publishes): stamped on the fresh pages, never below one
// the pool stamped before, so a freed page's old epoch never comes back.
TEST(KVCachePoolShared, ACallersEpochIsStampedAndNeverReused) {
  auto c = cache(8);
  KVCachePool pool(c, KVTransferInfo{"shm", {1}, 0});
  pool.adopt(1, 32, std::vector<std::uint32_t>{3, 5}, true, 1000);
  EXPECT_EQ(c->epochs().load(3), 1000u);
  EXPECT_EQ(pool.publish(1).kv_transfer_info.epoch, 1000u);
  // Sharing keeps the earlier epoch on the shared page, the new one elsewhere.
  pool.adopt(2, 32, std::vector<std::uint32_t>{3, 6}, true, 1001);
  EXPECT_EQ(c->epochs().load(3), 1000u);
  EXPECT_EQ(c->epochs().load(6), 1001u);
  pool.release(1);
  pool.release(2);
  EXPECT_EQ(c->epochs().load(3), 0u);
  // Equal to or below an epoch stamped before: refused, nothing changes.
  for (std::uint64_t e : {std::uint64_t{1001}, std::uint64_t{7}}) {
    SCOPED_TRACE("epoch " + std::to_string(e) + " taken again");
    testing::expect_error([&] { pool.adopt(3, 16, std::vector<std::uint32_t>{3}, true, e); },
                          StatusCode::kInvalidArgument, {"epoch " + std::to_string(e)});
  }
  EXPECT_FALSE(pool.contains(3));
  EXPECT_EQ(c->epochs().load(3), 0u);
  EXPECT_EQ(pool.free_page_count(), 8u);
  // The pool's own epochs continue above the callers'.
  const auto pages = pool.allocate(4, 16);
  EXPECT_GT(c->epochs().load(pages[0]), 1001u);
}

}  // namespace
}  // namespace mstar::kv
