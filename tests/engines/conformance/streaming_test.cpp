// Copyright mstar-kv authors.
//
// Layer-wise streaming against a real, deliberately slow owner process
// (kv_conformance_peer's "stream" command): every layer of the sequence holds
// a poison pattern until the owner writes it and marks it ready, so a reader
// that ever read a layer early would fail the byte-exact verify. Engines
// without a readiness channel must refuse streaming with kNotSupported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include "common/expectations.hpp"
#include "engine_suite.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {
namespace {

using namespace std::chrono_literals;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Streaming : public EngineSuite {
 protected:
  void need_readiness() {
    if (!remote_reads()) GTEST_SKIP() << "the local engine reads no remote cache";
    if (!GetParam().traits.layer_readiness) {
      GTEST_SKIP() << "the " << engine()
                   << " engine has no readiness channel yet: its refusal is "
                      "RefusedWithoutAReadinessChannel";
    }
  }
  // What a stream whose owner was killed fails with: shm sees the owner's
  // process gone (kNotFound), a networked engine its connection (kPeerFailure).
  StatusCode owner_gone() const {
    return GetParam().traits.crosses_hosts ? StatusCode::kPeerFailure : StatusCode::kNotFound;
  }

  // Starts the slow owner's stream: returns the unfinished sequence.
  static SequenceInfo start_owner_stream(PeerProcess& peer, int ms_per_layer, int layers) {
    peer.send("stream " + std::to_string(ms_per_layer) + " " + std::to_string(layers));
    return peer.read_sequence();
  }
  // Every byte of layer `layer` in `pages` still holds the sentinel. A host
  // cache is looked at in place, byte by byte with relaxed atomic loads: the
  // engine is writing other layers meanwhile (a copy of the whole cache
  // raced with those writes, which ThreadSanitizer reported).
  static bool layer_untouched(const KVCache& cache, std::uint32_t layer,
                              const std::vector<std::uint32_t>& pages) {
    std::shared_ptr<KVCache> host;
    if (cache.memory_kind() == MemoryKind::kDevice) host = testing::download(cache);
    const KVCache& c = host ? *host : cache;
    for (std::uint32_t kv = 0; kv < c.layout().num_kv(); ++kv) {
      for (std::uint32_t p : pages) {
        auto b = c.block(layer, static_cast<KV>(kv), p);
        for (std::byte& x : b) {
          if (__atomic_load_n(&x, __ATOMIC_RELAXED) != kSentinel) return false;
        }
      }
    }
    return true;
  }
  // The common start of a case: a slow owner of small_layout() streaming
  // `tokens` tokens ("stream <ms> <layers>"), the reader's cache and manager,
  // and a stream over all of it (lp: the local pages).
  void stream_from_owner(int ms, int layers, std::uint64_t tokens = 64,
                         std::chrono::milliseconds timeout = 5000ms) {
    owner_ = std::make_unique<PeerProcess>(peer_spec(l_, tokens));
    cache_ = local_cache(l_);
    m_ = manager(cache_, timeout);
    seq_ = start_owner_stream(*owner_, ms, layers);
    lp_ = local_pages(seq_.page_indices.size());
    s_ = m_->start_streaming_retrieve(0, tokens, lp_, seq_.page_indices, seq_.kv_transfer_info);
    ASSERT_TRUE(s_.has_value());
  }
  // The stream resolves within `limit` with `code`, its message naming each
  // of `needles`.
  void expect_stream_fails(StatusCode code, std::initializer_list<std::string_view> needles = {},
                           std::chrono::milliseconds limit = 5000ms) {
    ASSERT_TRUE(s_->future().wait_for(limit)) << "the stream did not resolve";
    const Status st = s_->future().status();
    EXPECT_EQ(st.code(), code) << st.to_string();
    for (std::string_view n : needles) {
      EXPECT_NE(st.message().find(n), std::string::npos)
          << "'" << n << "' is not in: " << st.message();
    }
  }
  const KVLayout l_ = small_layout();
  std::unique_ptr<PeerProcess> owner_;
  std::shared_ptr<KVCache> cache_;
  std::unique_ptr<KVTransferManager> m_;
  SequenceInfo seq_;
  std::vector<std::uint32_t> lp_;
  std::optional<LayerStream> s_;

  // Reads "MARKED <layer> <ns>" lines (skipping others) until `count` seen.
  static std::vector<std::int64_t> read_marks(PeerProcess& peer, std::uint32_t count) {
    std::vector<std::int64_t> t(count, 0);
    for (std::uint32_t seen = 0; seen < count;) {
      const std::string line = peer.read_line();
      if (line.rfind("MARKED ", 0) != 0) continue;
      const auto sp = line.find(' ', 7);
      t.at(std::stoul(line.substr(7, sp - 7))) = std::stoll(line.substr(sp + 1));
      ++seen;
    }
    return t;
  }
};

// The start of a case that streams: skips where the engine cannot.
#define MSTAR_KV_NEED_READINESS() \
  do {                            \
    need_readiness();             \
    if (IsSkipped()) return;      \
  } while (0)

// The start of a case that streams from the slow owner (stream_from_owner's
// arguments): skips where the engine cannot, ends the case if the stream
// did not start.
#define MSTAR_KV_STREAM_FROM_OWNER(...) \
  do {                                  \
    MSTAR_KV_NEED_READINESS();          \
    stream_from_owner(__VA_ARGS__);     \
    if (HasFatalFailure()) return;      \
  } while (0)

TEST_P(Streaming, RefusedWithoutAReadinessChannel) {
  MSTAR_KV_NEED_REMOTE();
  if (GetParam().traits.layer_readiness) GTEST_SKIP() << engine() << " has a readiness channel";
  const KVLayout l = small_layout();
  PeerProcess peer(peer_spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  try {
    m->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices, seq.kv_transfer_info);
    FAIL() << "streaming over " << engine() << " was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kNotSupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + engine() + "'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(layer_untouched(*cache, 0, local_pages(4)));
}

TEST_P(Streaming, EachLayerArrivesAfterTheOwnerMarksItAndBeforeTheNext) {
  MSTAR_KV_NEED_READINESS();
  const KVLayout l = small_layout();
  PeerProcess peer(peer_spec(l, 300));  // 19 pages, the last partial
  auto cache = local_cache(l);
  auto m = manager(cache);
  const SequenceInfo seq = start_owner_stream(peer, 150, 4);
  const auto lp = local_pages(seq.page_indices.size());
  std::mutex mu;
  std::vector<std::int64_t> done_at(l.num_layers, 0);
  StreamOptions o;
  o.on_layer = [&](std::uint32_t layer) {
    std::lock_guard<std::mutex> lock(mu);
    done_at[layer] = now_ns();
  };
  auto s =
      m->start_streaming_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info, o);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->num_layers(), 4u);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    const Status st = s->wait_for_layer(layer, 10s);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    // The owner marks the next layer 150 ms later: two layers ahead must
    // still be untouched here.
    if (layer + 2 < l.num_layers) {
      EXPECT_TRUE(layer_untouched(*cache, layer + 2, lp))
          << "layer " << layer + 2 << " was read before it was marked";
    }
  }
  EXPECT_EQ(s->future().get(), 300u * l.token_bytes() * 2 * l.num_layers);
  const auto marked = read_marks(peer, l.num_layers);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    EXPECT_GE(done_at[layer], marked[layer]) << "layer " << layer << " done before marked";
    if (layer + 1 < l.num_layers) {
      EXPECT_LT(done_at[layer], marked[layer + 1])
          << "layer " << layer << " arrived only after the owner marked the next one";
    }
  }
  // Byte-exact: no poison was ever copied.
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  // One read in the statistics (recorded by a callback just after waking us).
  for (int i = 0; i < 1000 && m->stats().total.reads_succeeded == 0; ++i) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(m->stats().total.reads_succeeded, 1u);
}

TEST_P(Streaming, PrefixHitAndDifferentOrdersStreamLikeAPull) {
  MSTAR_KV_NEED_READINESS();
  const KVLayout remote = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  PeerProcess peer(peer_spec(remote, 90));
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  auto cache = local_cache(l);
  auto m = manager(cache);
  const SequenceInfo seq = start_owner_stream(peer, 20, 4);
  const auto lp = local_pages(seq.page_indices.size());
  auto s = m->start_streaming_retrieve(37, 90, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->future().get(), (90u - 37u) * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 37, 90);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  // Tokens before the prefix hit were not touched (page 2 holds 32..47).
  const auto host = testing::download(*cache);
  const auto b = host->block(0, KV::kKey, lp[2]);
  EXPECT_EQ(b[0], kSentinel);
  EXPECT_FALSE(
      m->start_streaming_retrieve(90, 90, lp, seq.page_indices, seq.kv_transfer_info).has_value());
}

TEST_P(Streaming, LayersOverAMebibyteGoThroughTheEnginesWorkers) {
  MSTAR_KV_NEED_READINESS();
  KVLayout l = small_layout();
  l.num_pages = 1024;  // 512 pages x 2 x 4 KiB = 4 MiB per layer: not an inline copy
  PeerProcess peer(peer_spec(l, 512 * 16));
  auto cache = local_cache(l);
  auto m = manager(cache, 20000ms);  // sanitizer builds copy slowly
  const SequenceInfo seq = start_owner_stream(peer, 40, 4);
  std::vector<std::uint32_t> lp(seq.page_indices.size());
  for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(1023 - i);
  StreamOptions o;
  o.max_reads_in_flight = 2;
  auto s =
      m->start_streaming_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info, o);
  ASSERT_TRUE(s.has_value());
  ASSERT_TRUE(s->wait_for_layer(0, 30s).is_ok());
  EXPECT_EQ(s->future().get(), 512u * 16 * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_P(Streaming, AnotherGeometryStreamsLikeAPull) {
  MSTAR_KV_NEED_READINESS();
  // The owner: 8 heads, 16-token HND pages, page-major (then layer_page
  // NHD); the reader: tensor parallel rank 1 of 2 (heads 4..7), 64-token NHD
  // pages, layer-major (then layer_page HND).
  const std::pair<KVLayout, KVLayout> cases[] = {
      {shard_layout(16, 8, 0, 8, PageOrder::kHND, CacheOrder::kPageMajor, 64),
       shard_layout(64, 4, 4, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 16)},
      {shard_layout(16, 8, 0, 8, PageOrder::kNHD, CacheOrder::kLayerPage, 64),
       shard_layout(64, 4, 4, 8, PageOrder::kHND, CacheOrder::kLayerPage, 16)}};
  for (const auto& [owner, local] : cases) {
    SCOPED_TRACE(local.to_string() + " <- " + owner.to_string());
    PeerProcess peer(peer_spec(owner, 300));
    auto cache = local_cache(local);
    auto m = manager(cache);
    const SequenceInfo seq = start_owner_stream(peer, 20, 4);
    const std::vector<std::uint32_t> lp{9, 2, 14, 5, 0};  // ceil(300 / 64) pages
    auto s = m->start_streaming_retrieve(37, 300, lp, seq.page_indices, seq.kv_transfer_info);
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->future().get(), (300u - 37u) * local.token_bytes() * 2 * local.num_layers);
    auto v = testing::verify_pattern_any(*cache, kSeed, lp, 37, 300);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
  }
}

TEST_P(Streaming, AFinishedSequenceStreamsAsOneRead) {
  MSTAR_KV_NEED_READINESS();
  const KVLayout l = small_layout();
  PeerProcess peer(peer_spec(l, 200));  // published by publish(seq): every layer ready
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  const auto lp = local_pages(seq.page_indices.size());
  auto s = m->start_streaming_retrieve(0, 200, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->future().get(), 200u * l.token_bytes() * 2 * l.num_layers);
  EXPECT_EQ(s->layers_done(), l.num_layers);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 0, 200).ok());
}

TEST_P(Streaming, ALayerNeverMarkedTimesOut) {
  MSTAR_KV_NEED_READINESS();
  const KVLayout l = small_layout();
  PeerProcess peer(peer_spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache, 800ms);
  const SequenceInfo seq = start_owner_stream(peer, 0, 2);  // layers 2, 3 never
  const auto lp = local_pages(seq.page_indices.size());
  const auto t0 = std::chrono::steady_clock::now();
  auto s = m->start_streaming_retrieve(0, 64, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  ASSERT_TRUE(s->future().wait_for(10s));
  const auto took = std::chrono::steady_clock::now() - t0;
  const Status st = s->future().status();
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("layer 2 of 4"), std::string::npos) << st.message();
  EXPECT_GE(took, 800ms);
  EXPECT_LT(took, 3s);
  EXPECT_TRUE(s->wait_for_layer(1, 0s).is_ok());
  EXPECT_EQ(s->wait_for_layer(2, 0s).code(), StatusCode::kTimeout);
  EXPECT_TRUE(layer_untouched(*cache, 2, lp));
  EXPECT_TRUE(layer_untouched(*cache, 3, lp));
  const auto timeouts = [&] {
    return m->stats().total.reads_failed[static_cast<std::size_t>(StatusCode::kTimeout)];
  };
  for (int i = 0; i < 1000 && timeouts() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(timeouts(), 1u);
}

TEST_P(Streaming, CancelMidStreamStopsIssuingAndResolvesOnceNothingIsInFlight) {
  MSTAR_KV_STREAM_FROM_OWNER(300, 4, 128);
  ASSERT_TRUE(s_->wait_for_layer(0, 10s).is_ok());
  const auto t0 = std::chrono::steady_clock::now();
  s_->cancel();
  ASSERT_TRUE(s_->future().wait_for(2s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 250ms);
  EXPECT_EQ(s_->future().status().code(), StatusCode::kCancelled)
      << s_->future().status().to_string();
  EXPECT_EQ(s_->wait_for_layer(1, 0s).code(), StatusCode::kCancelled);
  // The owner_ goes on marking; nothing more lands here.
  read_marks(*owner_, 4);
  for (std::uint32_t layer = 1; layer < 4; ++layer) {
    EXPECT_TRUE(layer_untouched(*cache_, layer, lp_)) << "layer " << layer << " after cancel";
  }
}

TEST_P(Streaming, CancellingTheFutureCancelsTheStream) {
  MSTAR_KV_STREAM_FROM_OWNER(0, 0);
  s_->future().cancel();
  expect_stream_fails(StatusCode::kCancelled, {}, 2s);
}

TEST_P(Streaming, ReadinessBeyondTheLayerCountIsRejected) {
  MSTAR_KV_STREAM_FROM_OWNER(0, 0);
  owner_->send("rawready 9");
  ASSERT_NO_FATAL_FAILURE(
      expect_stream_fails(StatusCode::kCorruptDescriptor, {"says 9 layers", "4 layers"}));
  for (std::uint32_t layer = 0; layer < 4; ++layer)
    EXPECT_TRUE(layer_untouched(*cache_, layer, lp_));
}

TEST_P(Streaming, ReadinessGoingBackwardsIsRejected) {
  MSTAR_KV_STREAM_FROM_OWNER(0, 2);
  ASSERT_TRUE(s_->wait_for_layer(1, 10s).is_ok());
  read_marks(*owner_, 2);
  owner_->send("rawready 1");
  ASSERT_NO_FATAL_FAILURE(expect_stream_fails(
      StatusCode::kCorruptDescriptor, {"went backwards: 1 layers ready, 2 were ready before"}));
  EXPECT_TRUE(layer_untouched(*cache_, 2, lp_));
}

TEST_P(Streaming, ANewGenerationOfThePagesIsRejected) {
  MSTAR_KV_STREAM_FROM_OWNER(0, 1);
  ASSERT_TRUE(s_->wait_for_layer(0, 10s).is_ok());
  read_marks(*owner_, 1);
  owner_->send("reuse");  // same pages, new epoch, every layer "ready"
  const SequenceInfo next = owner_->read_sequence();
  EXPECT_EQ(next.page_indices, seq_.page_indices);
  ASSERT_NO_FATAL_FAILURE(expect_stream_fails(StatusCode::kStaleDescriptor));
  for (std::uint32_t layer = 1; layer < 4; ++layer)
    EXPECT_TRUE(layer_untouched(*cache_, layer, lp_));
}

TEST_P(Streaming, AnOwnerThatDiesMidStreamFailsTheStreamWithinTheTimeout) {
  MSTAR_KV_STREAM_FROM_OWNER(100, 4);
  ASSERT_TRUE(s_->wait_for_layer(0, 10s).is_ok());
  owner_->kill_now();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(s_->future().wait_for(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "the owner_'s_ death went unseen";
  const Status st = s_->future().status();
  EXPECT_EQ(st.code(), owner_gone()) << st.to_string();
  EXPECT_TRUE(layer_untouched(*cache_, 2, lp_));
  EXPECT_TRUE(layer_untouched(*cache_, 3, lp_));
}

TEST_P(Streaming, ShutdownResolvesAStreamWaitingForTheOwner) {
  MSTAR_KV_STREAM_FROM_OWNER(0, 1);
  ASSERT_TRUE(s_->wait_for_layer(0, 10s).is_ok());
  m_->cleanup();
  ASSERT_TRUE(s_->future().ready());
  EXPECT_EQ(s_->future().status().code(), StatusCode::kShutdown);
  testing::expect_error(
      [&] {
        m_->start_streaming_retrieve(0, 64, local_pages(4), seq_.page_indices,
                                     seq_.kv_transfer_info);
      },
      StatusCode::kShutdown);
}

TEST_P(Streaming, BadArgumentsAreRejectedBeforeAnyByteMoves) {
  MSTAR_KV_NEED_READINESS();
  const KVLayout l = small_layout();
  PeerProcess peer(peer_spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  auto code_of = [&](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return StatusCode::kOk;
  };
  KVTransferInfo no_epoch = seq.kv_transfer_info;
  no_epoch.epoch = 0;
  EXPECT_EQ(code_of([&] {
              m->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices, no_epoch);
            }),
            StatusCode::kInvalidArgument);
  KVLayout other = l;
  other.head_dim = 32;
  auto other_cache = local_cache(other);
  auto m2 = manager(other_cache);
  EXPECT_EQ(code_of([&] {
              m2->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices,
                                           seq.kv_transfer_info);
            }),
            StatusCode::kIncompatibleLayout);
  StreamOptions bad;
  bad.max_reads_in_flight = 0;
  EXPECT_EQ(code_of([&] {
              m->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices,
                                          seq.kv_transfer_info, bad);
            }),
            StatusCode::kInvalidArgument);
  auto s =
      m->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(s.has_value());
  EXPECT_THROW(s->wait_for_layer(4, 0s), Error);
  s->future().get();
  for (std::uint32_t layer = 0; layer < 4; ++layer) {
    EXPECT_TRUE(layer_untouched(*other_cache, layer, local_pages(4)));
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, Streaming, ::testing::ValuesIn(engine_cases()),
                         [](const ::testing::TestParamInfo<EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv::testing
