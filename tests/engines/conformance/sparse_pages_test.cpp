// Copyright mstar-kv authors.
//
// Sequences that own a sparse set of high-numbered pages, for every engine
// (each against a real peer process). The other suites' sequences own pages
// 0..N-1 of small caches, where a reader that fetched the page epochs or
// readiness words of the wrong pages (pages 0..n-1 instead of the read's)
// still saw the right values, and words written at an offset of page * 8
// stayed inside a 4 KiB scratch page: the Mooncake reader did both, unseen.
// Here the owner's cache has 4096 pages and the sequence 700 of them,
// scattered (mostly >= 512: beyond one 4 KiB page of 8-byte epochs, and
// more than one such page of them), so that misdirected words fail the read
// and misplaced ones land outside their page (ASan).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "engine_suite.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kPages = 700;
constexpr std::uint64_t kTokens = kPages * 16;

class SparsePages : public EngineSuite {
 protected:
  // 2 layers, 4096 pages of 16 tokens, 1 head x 64 bf16: 2 KiB blocks.
  const KVLayout l_ = make_layout(2, 4096, 16, 1, 64);

  // The reader's pages: scattered too, distinct (7 is prime to 4096).
  static std::vector<std::uint32_t> scattered_local(std::size_t n) {
    std::vector<std::uint32_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint32_t>((1000 + i * 7) % 4096);
    return v;
  }
  static void expect_sparse_and_high(const SequenceInfo& seq) {
    ASSERT_EQ(seq.page_indices.size(), kPages);
    std::size_t high = 0;
    for (std::uint32_t p : seq.page_indices) high += p >= 512;
    EXPECT_GT(high, kPages / 2) << "the owner's pages are not mostly >= 512";
    EXPECT_NE(seq.page_indices.front() + kPages - 1, seq.page_indices.back())
        << "the owner's pages are not scattered";
  }
  std::uint64_t bytes() const { return kTokens * l_.token_bytes() * 2 * l_.num_layers; }
};

TEST_P(SparsePages, APullOfSparseHighPagesIsByteExact) {
  MSTAR_KV_NEED_REMOTE();
  PeerProcess peer(peer_spec(l_, kTokens));
  const SequenceInfo& seq = peer.sequence();
  expect_sparse_and_high(seq);
  auto cache = local_cache(l_);
  auto m = manager(cache);
  const auto lp = scattered_local(seq.page_indices.size());
  EXPECT_EQ(m->sync_retrieve(0, kTokens, lp, seq.page_indices, seq.kv_transfer_info), bytes());
  const auto v = verify_pattern_any(*cache, kSeed, lp, 0, kTokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(*cache, l_, plan_reads(l_, 0, kTokens, lp, seq.page_indices));
}

TEST_P(SparsePages, ReusedSparseHighPagesFailStaleAndTheNewSequenceVerifies) {
  MSTAR_KV_NEED_REMOTE();
  PeerProcess peer(peer_spec(l_, kTokens));
  const SequenceInfo old = peer.sequence();
  auto cache = local_cache(l_);
  auto m = manager(cache);
  const auto lp = scattered_local(old.page_indices.size());
  ASSERT_EQ(m->sync_retrieve(0, kTokens, lp, old.page_indices, old.kv_transfer_info), bytes());
  // The owner frees sequence 1; sequence 2 gets the same pages (LIFO).
  const SequenceInfo next = peer.command("next 0");
  ASSERT_EQ(next.page_indices, old.page_indices);
  try {
    auto f = m->start_async_retrieve(0, kTokens, lp, old.page_indices, old.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    f->get();
    FAIL() << "a pull of freed pages succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kStaleDescriptor) << e.what();
  }
  ASSERT_EQ(m->sync_retrieve(0, kTokens, lp, next.page_indices, next.kv_transfer_info), bytes());
  const auto v = verify_pattern_any(*cache, kSeed + 2, lp, 0, kTokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_P(SparsePages, AStreamOfSparseHighPagesArrivesLayerByLayer) {
  MSTAR_KV_NEED_REMOTE();
  if (!GetParam().traits.layer_readiness) {
    GTEST_SKIP() << "the " << engine() << " engine has no readiness channel";
  }
  PeerProcess peer(peer_spec(l_, kTokens));
  auto cache = local_cache(l_);
  auto m = manager(cache);
  peer.send("stream 100 2");  // a second sequence of kPages, layer by layer
  const SequenceInfo seq = peer.read_sequence();
  expect_sparse_and_high(seq);
  const auto lp = scattered_local(seq.page_indices.size());
  auto s = m->start_streaming_retrieve(0, kTokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  ASSERT_TRUE(s->wait_for_layer(0, 10s).is_ok());
  EXPECT_EQ(s->future().get(), bytes());
  EXPECT_EQ(s->layers_done(), 2u);
  const auto v = verify_pattern_any(*cache, kSeed, lp, 0, kTokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(*cache, l_, plan_reads(l_, 0, kTokens, lp, seq.page_indices));
}

INSTANTIATE_TEST_SUITE_P(Engines, SparsePages, ::testing::ValuesIn(engine_cases()),
                         [](const ::testing::TestParamInfo<EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv::testing
