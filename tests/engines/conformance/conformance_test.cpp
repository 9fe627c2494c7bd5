// Copyright mstar-kv authors.
//
// The engine conformance suite: the same data checks, error cases and
// shutdown cases for every engine that is built and can run here, each
// against a real peer process (kv_conformance_peer). An engine that needs
// something absent skips with the reason printed.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <tuple>

#include "common/expectations.hpp"
#include "common/geometry_pulls.hpp"
#include "engine_suite.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {
namespace {

using namespace std::chrono_literals;

class Conformance : public EngineSuite {
 protected:
  // The common start of a case: a peer publishing `tokens` tokens of
  // `layout`, a reader's cache of the same layout and its manager.
  struct Pull {
    KVLayout layout;
    std::unique_ptr<PeerProcess> peer;
    std::shared_ptr<KVCache> cache;
    std::unique_ptr<KVTransferManager> m;
  };
  Pull pull_setup(const KVLayout& layout, std::uint64_t tokens,
                  std::chrono::milliseconds timeout = 5000ms) const {
    auto peer = std::make_unique<PeerProcess>(peer_spec(layout, tokens));
    auto cache = local_cache(layout);
    auto m = manager(cache, timeout);
    return {layout, std::move(peer), std::move(cache), std::move(m)};
  }
};

TEST_P(Conformance, FullPullMovesEveryByte) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] =
      pull_setup(small_layout(), 300);  // last page partial (300 = 18*16 + 12)
  const auto& seq = peer->sequence();
  const auto lp = local_pages(seq.page_indices.size());
  const std::uint64_t bytes =
      m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  EXPECT_EQ(bytes, 300u * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(*cache, l,
                                  plan_reads(l, 0, seq.num_tokens, lp, seq.page_indices));
}

TEST_P(Conformance, PrefixHitPullsOnlyTheTail) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(), 256);
  const auto& seq = peer->sequence();
  const auto lp = local_pages(seq.page_indices.size());
  const std::uint64_t start = 197;  // inside page 12
  auto f =
      m->start_async_retrieve(start, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->get(), (256u - start) * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, start, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(*cache, l,
                                  plan_reads(l, start, seq.num_tokens, lp, seq.page_indices));
}

TEST_P(Conformance, OrdersMayDifferBetweenTheTwoCaches) {
  MSTAR_KV_NEED_REMOTE();
  const KVLayout remote = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  for (auto [co, po] : {std::pair{CacheOrder::kLayerMajor, PageOrder::kNHD},
                        std::pair{CacheOrder::kPageMajor, PageOrder::kHND},
                        std::pair{CacheOrder::kLayerMajor, PageOrder::kHND},
                        std::pair{CacheOrder::kLayerPage, PageOrder::kNHD},
                        std::pair{CacheOrder::kLayerPage, PageOrder::kHND}}) {
    PeerProcess peer(peer_spec(remote, 90));
    const KVLayout l = small_layout(co, po);
    auto cache = local_cache(l);
    auto m = manager(cache);
    const auto& seq = peer.sequence();
    const auto lp = local_pages(seq.page_indices.size());
    m->sync_retrieve(5, 90, lp, seq.page_indices, seq.kv_transfer_info);
    auto v = testing::verify_pattern_any(*cache, kSeed, lp, 5, 90);
    EXPECT_TRUE(v.ok()) << l.to_string() << ": " << v.first_mismatch;
    expect_only_named_bytes_written(*cache, remote, plan_reads(l, 5, 90, lp, seq.page_indices));
  }
}

TEST_P(Conformance, NothingToReadReturnsNoFuture) {
  const KVLayout l = small_layout();
  auto cache = local_cache(l);
  auto m = manager(cache);
  if (!remote_reads()) {
    // The local engine's one valid read: nothing, of no remote cache.
    EXPECT_FALSE(m->start_async_retrieve(32, 32, local_pages(2), local_pages(2), KVTransferInfo{})
                     .has_value());
    expect_only_named_bytes_written(*cache, l, {});
    return;
  }
  PeerProcess peer(peer_spec(l, 32));
  const auto& seq = peer.sequence();
  EXPECT_FALSE(
      m->start_async_retrieve(32, 32, local_pages(2), seq.page_indices, seq.kv_transfer_info)
          .has_value());
  expect_only_named_bytes_written(*cache, l, {});
}

// A descriptor of any other engine (bytes it might even decode) is refused,
// naming that engine, before any byte moves; for every engine, local too.
TEST_P(Conformance, AnotherEnginesDescriptorIsRefusedBeforeAnyByteMoves) {
  const KVLayout l = small_layout();
  auto cache = local_cache(l);
  auto m = manager(cache);
  for (const EngineTraits& other : engine_table()) {
    if (other.name == engine() || !other.crosses_processes) continue;
    SCOPED_TRACE("a '" + other.name + "' descriptor");
    KVTransferInfo d;
    d.engine = other.name;
    d.payload.assign(96, 0x5A);
    for (const std::uint64_t end : {0u, 64u}) {
      expect_error([&] { m->start_async_retrieve(0, end, local_pages(4), local_pages(4), d); },
                   StatusCode::kInvalidArgument, {other.name});
    }
  }
  expect_only_named_bytes_written(*cache, l, {});
}

// An empty range is validated as a non-empty one is (manager.hpp): the
// descriptor, the layouts and the page tables, with the same errors.
TEST_P(Conformance, EmptyRangeIsValidatedFirst) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(), 64);
  const auto& seq = peer->sequence();
  const auto& good = seq.kv_transfer_info;
  auto code_of = [&](std::uint64_t at, std::span<const std::uint32_t> lp,
                     const KVTransferInfo& info, KVTransferManager& mgr) {
    try {
      EXPECT_FALSE(mgr.start_async_retrieve(at, at, lp, seq.page_indices, info).has_value());
      return std::make_pair(StatusCode::kOk, std::string());
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
  };
  for (std::uint64_t at : {0u, 32u, 40u}) {
    SCOPED_TRACE("start_len == end_len == " + std::to_string(at));
    EXPECT_EQ(code_of(at, local_pages(4), good, *m).first, StatusCode::kOk);
    KVTransferInfo truncated = good;
    truncated.payload.resize(good.payload.size() / 2);
    EXPECT_NE(code_of(at, local_pages(4), truncated, *m).first, StatusCode::kOk);
    KVTransferInfo other = good;
    other.engine = good.engine == "shm" ? "ucx" : "shm";
    EXPECT_NE(code_of(at, local_pages(4), other, *m).first, StatusCode::kOk);
    EXPECT_NE(code_of(at, local_pages(4), KVTransferInfo{}, *m).first, StatusCode::kOk);
  }
  // Mismatched layout: the same code and message as a non-empty pull.
  KVLayout narrow = small_layout();
  narrow.head_dim = 32;
  auto narrow_cache = local_cache(narrow);
  auto narrow_m = manager(narrow_cache);
  StatusCode code;
  std::string msg;
  std::tie(code, msg) = code_of(32, local_pages(4), good, *narrow_m);
  EXPECT_EQ(code, StatusCode::kIncompatibleLayout) << msg;
  EXPECT_NE(msg.find("head_dim"), std::string::npos) << msg;
  // Page tables: too short for end_len 40 (3 entries needed), and a local
  // page out of range in the entry holding token 40.
  const std::vector<std::uint32_t> two = local_pages(2);
  std::tie(code, msg) = code_of(40, two, good, *m);
  EXPECT_EQ(code, StatusCode::kInvalidArgument) << msg;
  EXPECT_NE(msg.find("local page table has 2 entries"), std::string::npos) << msg;
  std::vector<std::uint32_t> bad = local_pages(4);
  bad[2] = 64;
  std::tie(code, msg) = code_of(40, bad, good, *m);
  EXPECT_EQ(code, StatusCode::kInvalidArgument) << msg;
  EXPECT_NE(msg.find("local page 64 (table entry 2) out of range [0, 64)"), std::string::npos)
      << msg;
  // The remote table too, where the engine can tell the remote layout.
  std::vector<std::uint32_t> remote = seq.page_indices;
  remote[2] = 64;
  expect_error([&] { m->start_async_retrieve(40, 40, local_pages(4), remote, good); },
               StatusCode::kInvalidArgument,
               {"remote page 64 (table entry 2) out of range [0, 64)"});
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_P(Conformance, IncompatibleLayoutIsRejectedBeforeAnyByteMoves) {
  MSTAR_KV_NEED_REMOTE();
  PeerProcess peer(peer_spec(small_layout(), 64));
  KVLayout l = small_layout();
  l.head_dim = 32;
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  expect_error(
      [&] {
        m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, seq.kv_transfer_info);
      },
      StatusCode::kIncompatibleLayout, {"head_dim"});
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_P(Conformance, OutOfRangeRemotePageIsRejectedBeforeAnyByteMoves) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(), 64);
  auto remote = peer->sequence().page_indices;
  remote[2] = 64;  // one past the remote cache
  // Named by the caller's table entry, not an index into the plan.
  const std::string what = expect_error(
      [&] {
        m->start_async_retrieve(0, 64, local_pages(4), remote, peer->sequence().kv_transfer_info);
      },
      StatusCode::kInvalidArgument,
      {"remote page 64 (table entry 2) out of range [0, 64) in remote cache"});
  EXPECT_EQ(what.find("read"), std::string::npos) << what;
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_P(Conformance, CorruptDescriptorIsRejectedBeforeAnyByteMoves) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(), 64);
  const auto& seq = peer->sequence();
  // Truncated payloads and flipped bytes: every one is an Error thrown now
  // (or, where a flipped byte still decodes, a read that fails cleanly).
  const auto& good = seq.kv_transfer_info;
  for (std::size_t n = 0; n < good.payload.size();
       n += std::max<std::size_t>(1, good.payload.size() / 16)) {
    KVTransferInfo bad = good;
    bad.payload.resize(n);
    EXPECT_THROW(m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, bad), Error)
        << "payload truncated to " << n;
  }
  KVTransferInfo other = good;
  other.engine = good.engine == "shm" ? "ucx" : "shm";
  EXPECT_THROW(m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, other), Error);
  EXPECT_THROW(m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, KVTransferInfo{}),
               Error);
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_P(Conformance, DescriptorOfARestartedPeerIsRejected) {
  MSTAR_KV_NEED_REMOTE();
  const KVLayout l = small_layout();
  auto cache = local_cache(l);
  auto m = manager(cache, 3000ms);
  PeerProcess first(peer_spec(l, 64));
  const DeadPeer dead = read_then_kill(first, *m, 64, local_pages(4));
  const KVTransferInfo& stale = dead.descriptor;
  const std::vector<std::uint32_t>& remote_pages = dead.pages;
  testing::fill_bytes(*cache, kSentinel);
  PeerProcess second(peer_spec(l, 64));
  const auto t0 = std::chrono::steady_clock::now();
  bool failed = false;
  try {
    auto f = m->start_async_retrieve(0, 64, local_pages(4), remote_pages, stale);
    ASSERT_TRUE(f.has_value());
    ASSERT_TRUE(f->wait_for(10s)) << "future did not resolve";
    failed = !f->status().is_ok();
  } catch (const Error&) {
    failed = true;
  }
  EXPECT_TRUE(failed) << "a descriptor of a dead peer was read";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  expect_only_named_bytes_written(*cache, l, {});
  // The new peer's own descriptor works.
  const auto& seq = second.sequence();
  const auto lp = local_pages(seq.page_indices.size());
  m->sync_retrieve(0, 64, lp, seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 0, 64).ok());
}

TEST_P(Conformance, PeerKilledDuringReadResolvesInBoundedTime) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(2048), 2048 * 16, 3000ms);  // 64 MiB
  const auto& seq = peer->sequence();
  std::vector<std::uint32_t> lp(seq.page_indices.size());
  for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(i);
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<TransferFuture> f;
  try {
    f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  peer->kill_now();
  ASSERT_TRUE(f.has_value());
  ASSERT_TRUE(f->wait_for(15s)) << "no resolution 15 s after the peer died";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  if (f->status().is_ok()) {
    // Completed before or despite the death: then every byte must be right.
    auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens);
    EXPECT_TRUE(v.ok()) << "success reported with wrong bytes: " << v.first_mismatch;
  } else {
    EXPECT_NE(f->status().code(), StatusCode::kOk);
  }
  // The engine still works with a new peer.
  PeerProcess again(peer_spec(small_layout(), 64));
  auto cache2 = local_cache(small_layout());
  auto m2 = manager(cache2);
  m2->sync_retrieve(0, 64, local_pages(4), again.sequence().page_indices,
                    again.sequence().kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache2, kSeed, local_pages(4), 0, 64).ok());
}

TEST_P(Conformance, ShutdownResolvesEveryReadInFlight) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(1024), 1024 * 16, 20000ms);
  const auto& seq = peer->sequence();
  std::vector<TransferFuture> futures;
  for (std::uint32_t part = 0; part < 4; ++part) {
    std::vector<std::uint32_t> lp(256);
    std::vector<std::uint32_t> rp(256);
    for (std::uint32_t i = 0; i < 256; ++i) {
      lp[i] = part * 256 + i;
      rp[i] = seq.page_indices[part * 256 + i];
    }
    auto f = m->start_async_retrieve(0, 256 * 16, lp, rp, seq.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    futures.push_back(*f);
  }
  const auto t0 = std::chrono::steady_clock::now();
  m->cleanup();
  for (auto& f : futures) {
    // engine.hpp: shutdown() resolves every read in flight before it returns.
    ASSERT_TRUE(f.ready()) << "cleanup() returned with a read unresolved";
    const StatusCode c = f.status().code();
    EXPECT_TRUE(c == StatusCode::kOk || c == StatusCode::kShutdown || c == StatusCode::kCancelled)
        << f.status().to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  expect_error(
      [&] {
        m->start_async_retrieve(0, 16, std::vector<std::uint32_t>{0}, std::vector<std::uint32_t>{0},
                                seq.kv_transfer_info);
      },
      StatusCode::kShutdown);
  expect_quiet_after(*cache, futures.back());
  m->cleanup();  // idempotent
}

// 32 MiB in 1024 scattered pages: long enough for a cancel or a 1 ms
// deadline to land mid-read on a host (a device copies it in tens of
// microseconds: there cuda_ipc_engine_test queues 65,536 copies instead).
struct LongRead {
  KVLayout layout = small_layout(1024);
  std::vector<std::uint32_t> local_pages = std::vector<std::uint32_t>(1024);
  LongRead() {
    for (std::uint32_t i = 0; i < 1024; ++i) local_pages[i] = (i * 7) % 1024;
  }
  // The whole of `seq` (the peer's 1024 * 16 tokens) into local_pages.
  std::optional<TransferFuture> start(KVTransferManager& m, const SequenceInfo& seq) const {
    return m.start_async_retrieve(0, seq.num_tokens, local_pages, seq.page_indices,
                                  seq.kv_transfer_info);
  }
};

// A cancelled read resolves kCancelled (or kOk, when it had finished), and
// only once no byte of it can land; the engine keeps working.
TEST_P(Conformance, CancelResolvesOnlyOnceNothingLandsAfter) {
  MSTAR_KV_NEED_REMOTE();
  const LongRead r;
  auto [l, peer, cache, m] = pull_setup(r.layout, 1024 * 16, 20000ms);
  const auto& seq = peer->sequence();
  // Up to 40 tries, until 3 cancels landed mid-read (on a loaded machine a
  // read may finish before the cancel gets a core).
  int cancelled = 0;
  for (int i = 0; i < 40 && cancelled < 3; ++i) {
    auto f = r.start(*m, seq);
    ASSERT_TRUE(f.has_value());
    f->cancel();
    expect_quiet_after(*cache, *f);
    const StatusCode c = f->status().code();
    EXPECT_TRUE(c == StatusCode::kCancelled || c == StatusCode::kOk) << f->status().to_string();
    cancelled += c == StatusCode::kCancelled;
  }
  if (GetParam().traits.reader_memory != MemoryKind::kDevice) {
    EXPECT_GT(cancelled, 0) << "40 cancels of a 32 MiB read all came after it finished";
  }
  m->sync_retrieve(0, seq.num_tokens, r.local_pages, seq.page_indices, seq.kv_transfer_info);
  auto v = testing::verify_pattern_any(*cache, kSeed, r.local_pages, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

// A read past the engine's timeout (1 ms) fails kTimeout, saying so, and
// only once no byte of it can land; a read that made it is byte-exact. A
// deadline that hits while connecting fails the same way, before any byte.
TEST_P(Conformance, TimeoutResolvesOnlyOnceNothingLandsAfter) {
  MSTAR_KV_NEED_REMOTE();
  const LongRead r;
  auto [l, peer, cache, m] = pull_setup(r.layout, 1024 * 16, 1ms);
  const auto& seq = peer->sequence();
  int timeouts = 0;
  for (int i = 0; i < 40 && timeouts < 2; ++i) {
    testing::fill_bytes(*cache, kSentinel);
    std::optional<TransferFuture> f;
    try {
      f = r.start(*m, seq);
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), StatusCode::kTimeout) << e.what();
      expect_only_named_bytes_written(*cache, r.layout, {});
      ++timeouts;
      continue;
    }
    ASSERT_TRUE(f.has_value());
    expect_quiet_after(*cache, *f);
    if (f->status().code() == StatusCode::kTimeout) {
      ++timeouts;
      EXPECT_NE(f->status().message().find("did not finish in 1 ms"), std::string::npos)
          << f->status().message();
    } else {
      ASSERT_TRUE(f->status().is_ok()) << f->status().to_string();
      auto v = testing::verify_pattern_any(*cache, kSeed, r.local_pages, 0, seq.num_tokens);
      EXPECT_TRUE(v.ok()) << v.first_mismatch;
    }
  }
  if (GetParam().traits.reader_memory != MemoryKind::kDevice) {
    EXPECT_GT(timeouts, 0) << "a 32 MiB read never took more than 1 ms in 40 tries";
  }
}

// Threads pull disjoint pages through one manager, two reads in flight each.
TEST_P(Conformance, ConcurrentPullsFromManyThreads) {
  MSTAR_KV_NEED_REMOTE();
  auto [l, peer, cache, m] = pull_setup(small_layout(256), 256 * 16, 10000ms);
  const auto& seq = peer->sequence();
  constexpr int kThreads = 4;
  constexpr std::uint32_t kPagesEach = 64;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int rep = 0; rep < 3; ++rep) {
          std::vector<std::uint32_t> lp(kPagesEach);
          std::vector<std::uint32_t> rp(kPagesEach);
          for (std::uint32_t i = 0; i < kPagesEach; ++i) {
            lp[i] = static_cast<std::uint32_t>(t) * kPagesEach + (i * 7) % kPagesEach;
            rp[i] = seq.page_indices[static_cast<std::uint32_t>(t) * kPagesEach + i];
          }
          // Two reads in flight per thread: the two halves of its pages.
          const std::span<const std::uint32_t> l0(lp), r0(rp);
          auto f1 = m->start_async_retrieve(0, kPagesEach * 8, l0.first(kPagesEach / 2),
                                            r0.first(kPagesEach / 2), seq.kv_transfer_info);
          auto f2 = m->start_async_retrieve(0, kPagesEach * 8, l0.last(kPagesEach / 2),
                                            r0.last(kPagesEach / 2), seq.kv_transfer_info);
          f1->get();
          f2->get();
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  // Sequence page t*64 + i landed in local page t*64 + (i*7)%64.
  std::vector<std::uint32_t> table(kThreads * kPagesEach);
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    for (std::uint32_t i = 0; i < kPagesEach; ++i) {
      table[t * kPagesEach + i] = t * kPagesEach + (i * 7) % kPagesEach;
    }
  }
  auto v = testing::verify_pattern_any(*cache, kSeed, table, 0, kThreads * kPagesEach * 16);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

// Caches of different geometry (layout.hpp, planner.hpp): a decode cache of
// another page size, in-page order, cache order and head shard than the
// owner's, byte-exact by the pattern (keyed by model head and token
// position); bytes the read does not name keep the sentinel.
TEST_P(Conformance, MixedGeometriesPullByteExact) {
  MSTAR_KV_NEED_REMOTE();
  const KVLayout owner = geometry_owner();
  PeerProcess peer(peer_spec(owner, 300));
  for (const GeometryCase& c : geometry_cases()) {
    SCOPED_TRACE(c.what);
    auto cache = local_cache(c.local);
    auto m = manager(cache);
    expect_geometry_pull(*m, *cache, c, owner, peer.sequence(), 300, kSeed, kSentinel);
  }
  // A shard that does not hold the local heads is refused before any byte moves.
  {
    const KVLayout l = shard_layout(16, 4, 4, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 32);
    const KVLayout half = shard_layout(16, 4, 0, 8, PageOrder::kHND, CacheOrder::kPageMajor, 64);
    PeerProcess low(peer_spec(half, 100));
    auto cache = local_cache(l);
    auto m = manager(cache);
    expect_error(
        [&] {
          const std::vector<std::uint32_t> lp{0, 1, 2, 3, 4, 5, 6};
          m->start_async_retrieve(0, 100, lp, low.sequence().page_indices,
                                  low.sequence().kv_transfer_info);
        },
        StatusCode::kIncompatibleLayout, {"holds KV heads [0, 4) of 8"});
    expect_only_named_bytes_written(*cache, half, {});
  }
}

// TP 2 -> 1: one decode cache from two prefill ranks, each holding half the
// heads in its own page size; one future for the whole.
TEST_P(Conformance, TensorParallelMergeFromTwoPeers) {
  MSTAR_KV_NEED_REMOTE();
  const KVLayout r0 = shard_layout(16, 4, 0, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 64);
  const KVLayout r1 = shard_layout(32, 4, 4, 8, PageOrder::kHND, CacheOrder::kPageMajor, 32);
  PeerProcess p0(peer_spec(r0, 200));
  PeerProcess p1(peer_spec(r1, 200));
  const KVLayout l = shard_layout(64, 8, 0, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 16);
  auto cache = local_cache(l);
  auto m = manager(cache);
  const std::vector<std::uint32_t> lp{9, 2, 14, 5};
  const std::vector<KVTransferManager::RemoteShard> shards{
      {p0.sequence().page_indices, p0.sequence().kv_transfer_info},
      {p1.sequence().page_indices, p1.sequence().kv_transfer_info}};
  auto f = m->start_async_retrieve(0, 200, lp, shards);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->get(), 200u * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, 200);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  // Without the second rank, heads 4-7 are held by nobody: refused.
  testing::fill_bytes(*cache, kSentinel);
  expect_error([&] { m->start_async_retrieve(0, 200, lp, std::span(shards).first(1)); },
               StatusCode::kIncompatibleLayout, {"local KV heads [4, 8) of 8 are held by none"});
  expect_only_named_bytes_written(*cache, r0, {});
}

INSTANTIATE_TEST_SUITE_P(Engines, Conformance, ::testing::ValuesIn(engine_cases()),
                         [](const ::testing::TestParamInfo<EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv::testing
