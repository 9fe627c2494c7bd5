// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "mstar/kv/pool.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {
namespace {

std::shared_ptr<KVCache> cache(std::uint32_t pages) {
  KVLayout l;
  l.num_layers = 1;
  l.num_pages = pages;
  l.page_size = 16;
  l.num_kv_heads = 1;
  l.head_dim = 8;
  return KVCache::create_host(l);
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
  try {
    pool.allocate(2, 32);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kRetryLater);
    EXPECT_NE(std::string(e.what()).find("need 2 pages, 1 free of 4"), std::string::npos);
  }
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
  EXPECT_EQ(s.kv_transfer_info, info);
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

}  // namespace
}  // namespace mstar::kv
