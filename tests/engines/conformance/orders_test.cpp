// Copyright mstar-kv authors.
//
// The three cache orders (layout.hpp: layer-major, page-major, layer_page)
// through every engine that runs here, against real peer processes: a pull
// between every pair of orders, in one geometry (the coalesced fast path)
// and across a tensor-parallel split, a page-size change and NHD <-> HND at
// once, byte-exact by the pattern; bytes the read does not name keep the
// sentinel. And a descriptor naming an order this build does not know is
// refused by name before any byte moves.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/expectations.hpp"
#include "core/codec.hpp"
#include "engine_suite.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {
namespace {

constexpr CacheOrder kOrders[] = {CacheOrder::kLayerMajor, CacheOrder::kPageMajor,
                                  CacheOrder::kLayerPage};
constexpr std::uint64_t kTokens = 150;  // the last 16-token page partial

class CacheOrders : public EngineSuite {
 protected:
  // Pulls tokens [start, kTokens) of the peer's sequence into a fresh cache
  // of layout `l` and checks every byte of it.
  void pull_and_check(const PeerProcess& peer, const KVLayout& owner, const KVLayout& l,
                      std::uint64_t start) const {
    SCOPED_TRACE(l.to_string() + " <- " + owner.to_string() + " from token " +
                 std::to_string(start));
    auto cache = local_cache(l);
    auto m = manager(cache);
    const auto& seq = peer.sequence();
    const std::size_t n = (kTokens + l.page_size - 1) / l.page_size;
    std::vector<std::uint32_t> lp(n);
    for (std::size_t i = 0; i < n; ++i) {
      lp[i] = static_cast<std::uint32_t>((i * 5 + 3) % l.num_pages);  // scattered
    }
    const std::uint64_t bytes =
        m->sync_retrieve(start, kTokens, lp, seq.page_indices, seq.kv_transfer_info);
    EXPECT_EQ(bytes, (kTokens - start) * l.token_bytes() * l.num_kv() * l.num_layers);
    auto v = verify_pattern_any(*cache, kSeed, lp, start, kTokens);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    expect_only_named_bytes_written(*cache, owner,
                                    plan_reads(l, owner, start, kTokens, lp, seq.page_indices));
  }
};

// For each owner order: a reader in each order with the owner's geometry,
// and one holding heads 4-7 of 8 (TP 1 -> 2, rank 1) in pages of another
// size and the other in-page order.
TEST_P(CacheOrders, EveryPairOfOrdersPullsByteExact) {
  MSTAR_KV_NEED_REMOTE();
  for (CacheOrder rco : kOrders) {
    const PageOrder rpo = rco == CacheOrder::kPageMajor ? PageOrder::kHND : PageOrder::kNHD;
    const PageOrder other = rpo == PageOrder::kNHD ? PageOrder::kHND : PageOrder::kNHD;
    const KVLayout owner = shard_layout(16, 8, 0, 8, rpo, rco, 64);
    PeerProcess peer(peer_spec(owner, kTokens));
    for (CacheOrder lco : kOrders) {
      pull_and_check(peer, owner, shard_layout(16, 8, 0, 8, rpo, lco, 64), 0);
      const std::uint32_t page_size = lco == CacheOrder::kLayerPage ? 8 : 32;
      pull_and_check(peer, owner, shard_layout(page_size, 4, 4, 8, other, lco, 48), 21);
    }
  }
}

// MLA's single latent: layer_page and layer-major are the same bytes, and
// either reads the other (and page-major) exactly.
TEST_P(CacheOrders, LatentCachesInEveryOrder) {
  MSTAR_KV_NEED_REMOTE();
  KVLayout owner = small_layout(CacheOrder::kLayerPage, PageOrder::kNHD);
  owner.has_v = false;
  owner.num_kv_heads = 1;
  owner.head_dim = 576;  // DeepSeek's 512 + 64 latent
  PeerProcess peer(peer_spec(owner, kTokens));
  for (CacheOrder lco : kOrders) {
    KVLayout l = owner;
    l.cache_order = lco;
    pull_and_check(peer, owner, l, 0);
    l.page_size = 64;
    l.num_pages = 16;
    pull_and_check(peer, owner, l, 40);
  }
}

// A layer_page descriptor whose order byte says 3: the reader refuses it as
// corrupt, naming the field and the value, for an empty range and a real
// one, and writes nothing; the descriptor as published still pulls.
TEST_P(CacheOrders, OrderOutOfRangeInADescriptorIsRefusedByName) {
  MSTAR_KV_NEED_REMOTE();
  const KVLayout l = small_layout(CacheOrder::kLayerPage, PageOrder::kHND);
  PeerProcess peer(peer_spec(l, 64));
  const auto& seq = peer.sequence();
  auto cache = local_cache(l);
  auto m = manager(cache);
  // The layout's wire bytes (codec.cpp) appear once in every engine's
  // payload; byte 22 of them is the cache order.
  codec::ByteWriter w;
  w.layout(l);
  const std::vector<std::uint8_t> wire = w.take();
  KVTransferInfo bad = seq.kv_transfer_info;
  auto& p = bad.payload;
  const auto at = std::search(p.begin(), p.end(), wire.begin(), wire.end());
  ASSERT_NE(at, p.end()) << "the layout's bytes are not in the " << bad.engine << " payload";
  ASSERT_EQ(std::search(at + 1, p.end(), wire.begin(), wire.end()), p.end());
  ASSERT_EQ(at[22], static_cast<std::uint8_t>(CacheOrder::kLayerPage));
  at[22] = 3;
  const auto lp = local_pages(4);
  for (const std::uint64_t end : {0u, 64u}) {
    SCOPED_TRACE("tokens [0, " + std::to_string(end) + ")");
    expect_error([&] { m->start_async_retrieve(0, end, lp, seq.page_indices, bad); },
                 StatusCode::kCorruptDescriptor,
                 {"field 'layout'", "cache_order 3 out of range [0, 2]"});
  }
  expect_only_named_bytes_written(*cache, l, {});
  m->sync_retrieve(0, 64, lp, seq.page_indices, seq.kv_transfer_info);
  auto v = verify_pattern_any(*cache, kSeed, lp, 0, 64);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

INSTANTIATE_TEST_SUITE_P(Engines, CacheOrders, ::testing::ValuesIn(engine_cases()),
                         [](const ::testing::TestParamInfo<EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv::testing
