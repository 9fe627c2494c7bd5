// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

std::shared_ptr<KVCache> cache(std::uint32_t pages) {
  return KVCache::create_host(testing::make_layout(1, pages, 16, 1, 8));
}

TEST(KVCachePool, AllocatesCeilTokensOverPageSize) {
  KVCachePool pool(cache(10), {});
  auto a = pool.allocate(1, 33);  // 3 pages
  EXPECT_EQ(a, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(pool.allocate(2, 16).size(), 1u);
  EXPECT_EQ(pool.allocate(3, 0).size(), 0u);
  EXPECT_EQ(pool.free_page_count(), 6u);
}

TEST(KVCachePool, ExhaustionIsRetryLaterAndChangesNothing) {
  KVCachePool pool(cache(4), {});
  pool.allocate(1, 48);
  testing::expect_error([&] { pool.allocate(2, 32); }, StatusCode::kRetryLater,
                        {"need 2 pages, 1 free of 4"});
  EXPECT_FALSE(pool.contains(2));
  EXPECT_EQ(pool.free_page_count(), 1u);
}

TEST(KVCachePool, DoubleFreeIsRejected) {
  KVCachePool pool(cache(4), {});
  pool.allocate(1, 20);
  pool.release(1);
  EXPECT_EQ(pool.free_page_count(), 4u);
  EXPECT_THROW(pool.release(1), Error);
  auto pages = pool.allocate_pages(2);
  pool.free_pages(pages);
  EXPECT_THROW(pool.free_pages(pages), Error);
  auto p2 = pool.allocate_pages(1);
  const std::vector<std::uint32_t> twice = {p2[0], p2[0]};
  EXPECT_THROW(pool.free_pages(twice), Error);
  EXPECT_EQ(pool.free_page_count(), 3u);  // the failed free changed nothing
  const std::vector<std::uint32_t> oob = {4};
  EXPECT_THROW(pool.free_pages(oob), Error);
}

TEST(KVCachePool, DuplicateSequenceIsRejected) {
  KVCachePool pool(cache(4), {});
  pool.allocate(7, 1);
  EXPECT_THROW(pool.allocate(7, 1), Error);
}

TEST(KVCachePool, PublishStampsTheDescriptor) {
  const KVTransferInfo info{"shm", {1, 2, 3}};
  KVCachePool pool(cache(8), info);
  auto pages = pool.allocate(5, 40);
  SequenceInfo s = pool.publish(5);
  EXPECT_EQ(s.seq_id, 5u);
  EXPECT_EQ(s.num_tokens, 40u);
  EXPECT_EQ(s.page_indices, pages);
  // The layout's page size rides along, so that decode checks the count.
  EXPECT_EQ(s.page_size, pool.cache().layout().page_size);
  EXPECT_EQ(SequenceInfo::decode(s.encode()), s);
  EXPECT_EQ(s.kv_transfer_info.engine, info.engine);
  EXPECT_EQ(s.kv_transfer_info.payload, info.payload);
  // The sequence's epoch rides on its descriptor and sits on its pages.
  EXPECT_NE(s.kv_transfer_info.epoch, 0u);
  for (std::uint32_t p : pages) EXPECT_EQ(pool.cache().epochs().load(p), s.kv_transfer_info.epoch);
  EXPECT_THROW(pool.publish(6), Error);
}

TEST(KVCachePool, ScatterSeedScattersDeterministically) {
  KVCachePool a(cache(64), {}, 7);
  KVCachePool b(cache(64), {}, 7);
  auto pa = a.allocate(1, 16 * 20);
  EXPECT_EQ(pa, b.allocate(1, 16 * 20));
  EXPECT_FALSE(std::is_sorted(pa.begin(), pa.end()));
  EXPECT_EQ(std::set<std::uint32_t>(pa.begin(), pa.end()).size(), pa.size());
}

TEST(KVCachePool, EveryAllocationGetsAFreshEpochAndFreedPagesCarryZero) {
  KVCachePool pool(cache(4), KVTransferInfo{"shm", {1}});
  const PageEpochs& ep = pool.cache().epochs();
  auto a = pool.allocate(1, 32);
  const std::uint64_t ea = pool.publish(1).kv_transfer_info.epoch;
  pool.release(1);
  for (std::uint32_t p : a) EXPECT_EQ(ep.load(p), 0u);
  // LIFO free list: the same pages go to the next sequence, with a new epoch.
  auto b = pool.allocate(2, 32);
  EXPECT_EQ(b, a);
  const std::uint64_t eb = pool.publish(2).kv_transfer_info.epoch;
  EXPECT_NE(ea, eb);
  for (std::uint32_t p : b) EXPECT_EQ(ep.load(p), eb);
  // Reusing the seq id does not reuse the epoch either.
  pool.release(2);
  pool.allocate(1, 32);
  EXPECT_NE(pool.publish(1).kv_transfer_info.epoch, ea);
  auto raw = pool.allocate_pages(1);
  EXPECT_NE(ep.load(raw[0]), 0u);
  pool.free_pages(raw);
  EXPECT_EQ(ep.load(raw[0]), 0u);
}

TEST(KVCachePool, DoneFreesOnlyTheSequenceOfThatEpoch) {
  KVCachePool pool(cache(4), KVTransferInfo{"shm", {1}});
  pool.allocate(1, 16);
  const std::uint64_t e1 = pool.publish(1).kv_transfer_info.epoch;
  pool.release(1);
  pool.allocate(1, 16);            // the same id, a new request
  EXPECT_FALSE(pool.done(1, e1));  // a late done for the old one
  EXPECT_TRUE(pool.contains(1));
  EXPECT_TRUE(pool.done(1, pool.publish(1).kv_transfer_info.epoch));
  EXPECT_FALSE(pool.contains(1));
  EXPECT_FALSE(pool.done(1));
  EXPECT_EQ(pool.free_page_count(), 4u);
}

TEST(KVCachePool, PublishedSequencesExpireAfterTheLease) {
  EXPECT_EQ(KVCachePool::kDefaultLease, std::chrono::milliseconds(60000));
  EXPECT_THROW(KVCachePool(cache(4), {}, 0, std::chrono::milliseconds(-1)), Error);
  KVCachePool pool(cache(4), KVTransferInfo{"shm", {1}}, 0, std::chrono::milliseconds(50));
  auto pages = pool.allocate(1, 16);
  pool.allocate(2, 16);  // never published: no lease
  const auto before = std::chrono::system_clock::now();
  SequenceInfo s = pool.publish(1);
  const auto want_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           (before + std::chrono::milliseconds(50)).time_since_epoch())
                           .count();
  EXPECT_NEAR(static_cast<double>(s.lease_expiry_ms), static_cast<double>(want_ms), 20.0);
  EXPECT_EQ(pool.expire_leases(), 0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  EXPECT_EQ(pool.expire_leases(), 1u);
  EXPECT_FALSE(pool.contains(1));
  EXPECT_TRUE(pool.contains(2));
  EXPECT_EQ(pool.cache().epochs().load(pages[0]), 0u);
  EXPECT_EQ(pool.expired_count(), 1u);
  pool.release(1);  // freed by expiry already: a no-op
  EXPECT_THROW(pool.release(1), Error);
  EXPECT_EQ(pool.free_page_count(), 3u);
  // Expiry is also reaped lazily by allocate.
  pool.publish(2);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  pool.allocate(3, 16);
  EXPECT_FALSE(pool.contains(2));
}

TEST(KVCachePool, LeaseZeroNeverExpires) {
  KVCachePool pool(cache(4), KVTransferInfo{"shm", {1}}, 0, std::chrono::milliseconds(0));
  pool.allocate(1, 16);
  EXPECT_EQ(pool.publish(1).lease_expiry_ms, 0u);
  EXPECT_EQ(pool.expire_leases(), 0u);
  EXPECT_TRUE(pool.contains(1));
}

// Found by an adopter: allocate(seq, UINT64_MAX) wrapped the page count to 0.
TEST(KVCachePool, HugeTokenCountIsRejectedNotWrapped) {
  KVCachePool pool(cache(4), {});
  for (std::uint64_t n :
       {~std::uint64_t{0}, ~std::uint64_t{0} - 1, ~std::uint64_t{0} - 2, std::uint64_t{65}}) {
    SCOPED_TRACE(n);
    testing::expect_error([&] { pool.allocate(1, n); }, StatusCode::kInvalidArgument,
                          {std::to_string(n) + " tokens"});
    EXPECT_FALSE(pool.contains(1));
    EXPECT_EQ(pool.free_page_count(), 4u);
  }
  EXPECT_EQ(pool.allocate(1, 64).size(), 4u);  // the whole cache is fine
}

// Found by an adopter: free_pages() of a live sequence's page let a second
// sequence get it, so two live requests shared KV memory.
TEST(KVCachePool, FreePagesOfALiveSequencesPageIsRefused) {
  KVCachePool pool(cache(4), {});
  const auto owned = pool.allocate(7, 32);  // 2 pages
  const std::vector<std::uint32_t> one = {owned[1]};
  testing::expect_error([&] { pool.free_pages(one); }, StatusCode::kInvalidArgument,
                        {"sequence 7 holds"});
  EXPECT_EQ(pool.free_page_count(), 2u);
  const auto other = pool.allocate(8, 32);
  for (std::uint32_t p : other) {
    EXPECT_EQ(std::count(owned.begin(), owned.end(), p), 0) << "page " << p << " shared";
  }
  // A loose page mixed with an owned one: nothing is freed.
  pool.release(8);
  const auto loose = pool.allocate_pages(1);
  const std::vector<std::uint32_t> mixed = {loose[0], owned[0]};
  EXPECT_THROW(pool.free_pages(mixed), Error);
  EXPECT_EQ(pool.free_page_count(), 1u);
  pool.free_pages(loose);
  pool.release(7);
  EXPECT_EQ(pool.free_page_count(), 4u);
}

// pool.hpp: release of an unknown sequence is a double free
// (kInvalidArgument); pages and publish of one are kNotFound.
TEST(KVCachePool, UnknownSequenceErrorsMatchTheHeader) {
  KVCachePool pool(cache(4), {});
  testing::expect_error([&] { pool.release(9); }, StatusCode::kInvalidArgument);
  testing::expect_error([&] { (void)pool.pages(9); }, StatusCode::kNotFound);
  testing::expect_error([&] { (void)pool.publish(9); }, StatusCode::kNotFound);
}

// adopt: a sequence over the caller's pages (vLLM's blocks), stamped with a
// fresh epoch; the pages leave the free list; a refused call changes nothing.
TEST(KVCachePool, AdoptTakesTheCallersPagesWithAFreshEpoch) {
  auto c = cache(8);
  KVCachePool pool(c, {});
  const std::vector<std::uint32_t> pages = {5, 2, 7};
  pool.adopt(1, 40, pages);  // 3 pages of 16
  EXPECT_EQ(pool.pages(1), pages);
  EXPECT_EQ(pool.free_page_count(), 5u);
  const std::uint64_t e = c->epochs().load(5);
  EXPECT_NE(e, 0u);
  EXPECT_EQ(c->epochs().load(2), e);
  EXPECT_EQ(c->epochs().load(0), 0u);
  for (std::uint32_t p : pool.allocate(2, 16 * 5)) {  // the other five, never 2, 5, 7
    EXPECT_TRUE(p != 2 && p != 5 && p != 7) << p;
  }
  EXPECT_NE(c->epochs().load(0), e);
  EXPECT_TRUE(pool.done(1, e));
  EXPECT_EQ(c->epochs().load(5), 0u);
  EXPECT_EQ(pool.free_page_count(), 3u);
  pool.adopt(3, 0, std::vector<std::uint32_t>{});
  EXPECT_TRUE(pool.contains(3));
}

TEST(KVCachePool, AdoptRefusesBadPagesAndChangesNothing) {
  auto c = cache(8);
  KVCachePool pool(c, {});
  const auto held = pool.allocate(1, 16);     // page 0
  const auto loose = pool.allocate_pages(1);  // page 1
  struct Case {
    std::vector<std::uint32_t> pages;
    std::uint64_t tokens;
    const char* says;
  };
  const Case cases[] = {
      {{3, 4}, 40, "40 tokens need 3 pages of 16 tokens, 2 given"},
      {{3, 8}, 32, "page 8 out of range [0, 8)"},
      {{3, 3}, 32, "page 3 is named twice"},
      {{3, held[0]}, 32, "is held by a live sequence"},
      {{3, loose[0]}, 32, "is held (allocate_pages)"},
  };
  for (const Case& k : cases) {
    testing::expect_error([&] { pool.adopt(2, k.tokens, k.pages); }, StatusCode::kInvalidArgument,
                          {k.says});
    EXPECT_FALSE(pool.contains(2));
    EXPECT_EQ(pool.free_page_count(), 6u);
    EXPECT_EQ(c->epochs().load(3), 0u);
  }
  EXPECT_THROW(pool.adopt(1, 16, std::vector<std::uint32_t>{5}), Error);  // id taken
  pool.adopt(2, 32, std::vector<std::uint32_t>{3, 4});  // the pages are still free
  EXPECT_EQ(pool.free_page_count(), 4u);
}

}  // namespace
}  // namespace mstar::kv
