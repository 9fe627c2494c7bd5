// Copyright mstar-kv authors.
//
// What holds Mooncake's registrations, and for how long, against a real
// peer process running Mooncake (skips without MSTAR_KV_MOONCAKE_LIB). Each
// epoch-checked read and each layer watch registers a 4 KiB scratch page;
// shutdown() used to wait until every one was let go, so a watch (or an
// aborted read) held across it hung the engine's shutdown forever.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "common/layouts.hpp"
#include "common/peer_process.hpp"
#include "engines/mooncake/mooncake_test_util.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;

class MooncakeLifetime : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::mooncake_skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  // 600 pages scattered over 2048 (mostly >= 512).
  const KVLayout l_ = testing::mooncake_test_layout(2048);
  static constexpr std::uint64_t kTokens = 600 * 16;
  PeerSpec spec() const {
    PeerSpec s;
    s.engine = "mooncake";
    s.layout = l_;
    s.tokens = kTokens;
    s.seed = testing::kSeed;
    s.scatter_seed = 7;
    return s;
  }
};

TEST_F(MooncakeLifetime, AWatchHeldAcrossShutdownNeitherBlocksItNorOutlivesTheEngine) {
  PeerProcess peer(spec());
  peer.send("stream 2000 2");  // an owner still computing: the watch polls
  const SequenceInfo seq = peer.read_sequence();
  auto cache = testing::sentinel_cache(l_);
  auto engine = std::make_unique<MooncakeKVTransferEngine>(
      cache, TransferEngineInfo{"reader", "", "mooncake", {}});
  const auto lp = testing::iota_pages(seq.page_indices.size(), 1000);
  const auto reads = plan_reads(l_, 0, kTokens, lp, seq.page_indices);
  const RemoteHandle remote = engine->open_remote(seq.kv_transfer_info);
  auto watch = engine->watch_layers(*remote, reads);
  std::uint32_t ready = 99;
  const auto until = std::chrono::steady_clock::now() + 200ms;
  while (std::chrono::steady_clock::now() < until) {
    ASSERT_TRUE(watch->poll(&ready).is_ok());
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(ready, 0u) << "no layer was marked yet";
  const auto t0 = std::chrono::steady_clock::now();
  engine->shutdown();  // the watch still holds its scratch page
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "shutdown waited for the watch";
  engine.reset();  // the engine goes first: the watch then only frees its page
  watch.reset();
  EXPECT_EQ(testing::count_changed(*cache), 0u);
}

TEST_F(MooncakeLifetime, AFinishedStreamsWatchDoesNotHoldUpCleanup) {
  PeerProcess peer(spec());
  const SequenceInfo& seq = peer.sequence();  // finished: every layer ready
  auto cache = testing::sentinel_cache(l_);
  KVTransferManager m(TransferEngineInfo{"reader", "", "mooncake", {}}, cache);
  const auto lp = testing::iota_pages(seq.page_indices.size(), 1000);
  auto s = m.start_streaming_retrieve(0, kTokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  s->future().get();
  const auto v = verify_pattern(*cache, testing::kSeed, lp, 0, kTokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  const auto t0 = std::chrono::steady_clock::now();
  m.cleanup();  // the caller still holds the stream
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

}  // namespace
}  // namespace mstar::kv
