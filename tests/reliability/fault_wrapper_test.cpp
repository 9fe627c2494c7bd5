// Copyright mstar-kv authors.
//
// The fault wrapper around a real in-process engine: each fault does what it
// says, and every invariant holds after it (future resolves in time, no byte
// lands after resolution, pages not named stay untouched).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "common/layouts.hpp"
#include "mstar/kv/engines/fault_injection.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "reliability/inproc_engine.hpp"
#include "reliability/invariants.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::InProcessEngine;
using testing::ReadChecker;

KVLayout small_layout() { return testing::make_layout(2, 16, 8, 2, 16); }

// A local and a remote cache, a sequence of `tokens` tokens filled with the
// pattern on the remote side, and the reads that pull it. Page tables are
// scattered so that copies do not coalesce into one span.
struct Rig {
  explicit Rig(std::uint64_t num_tokens = 40) : tokens(num_tokens) {
    layout = small_layout();
    local = KVCache::create_host(layout);
    remote = KVCache::create_host(layout);
    lpages = {3, 9, 1, 14, 6};
    rpages = {10, 2, 7, 0, 12};
    fill_pattern(*remote, seed, rpages, 0, tokens);
    reads = plan_reads(layout, 0, tokens, lpages, rpages);
  }

  std::unique_ptr<FaultInjectingEngine> wrap(FaultConfig cfg, std::chrono::milliseconds pause = 0ms,
                                             FaultInjectingEngine::KillHook hook = {}) {
    auto inner = std::make_unique<InProcessEngine>(local, remote, pause);
    inner_ = inner.get();
    return std::make_unique<FaultInjectingEngine>(std::move(inner), layout, cfg, std::move(hook));
  }
  InProcessEngine& inner() { return *inner_; }
  std::uint64_t batch_bytes() const {
    return tokens * layout.token_bytes() * layout.num_kv() * layout.num_layers;
  }
  bool data_ok() const { return verify_pattern(*local, seed, lpages, 0, tokens).ok(); }

  std::uint64_t tokens;
  std::uint64_t seed = 42;
  KVLayout layout;
  std::shared_ptr<KVCache> local, remote;
  std::vector<std::uint32_t> lpages, rpages;
  std::vector<KVReadInfo> reads;
  KVTransferInfo info{"inproc", {}};

 private:
  InProcessEngine* inner_ = nullptr;
};

TEST(FaultWrapper, WithoutFaultsPassesBytesThrough) {
  const auto before = testing::ResourceSnapshot::take();
  {
    Rig rig;
    auto e = rig.wrap({});
    EXPECT_EQ(e->get_kv_transfer_info(), rig.info);
    ReadChecker check(*rig.local, rig.layout, rig.reads);
    auto f = e->read_batched_async(rig.info, rig.reads);
    ASSERT_TRUE(f);
    EXPECT_EQ(check.check(*f, 5s), "");
    ASSERT_TRUE(f->status().is_ok()) << f->status().to_string();
    EXPECT_EQ(f->bytes(), rig.batch_bytes());
    EXPECT_TRUE(rig.data_ok());
    EXPECT_EQ(e->counters().total(), 0u);
    EXPECT_EQ(e->counters().batches, 1u);
    EXPECT_FALSE(e->read_batched_async(rig.info, {}).has_value());
  }
  const auto after = testing::ResourceSnapshot::take();
  EXPECT_LE(after.fds, before.fds) << after.leaks_since(before);
}

TEST(FaultWrapper, DelayIssuesTheBatchLater) {
  Rig rig;
  FaultConfig cfg;
  cfg.delay = 150ms;
  auto e = rig.wrap(cfg);
  ReadChecker check(*rig.local, rig.layout, rig.reads);
  const auto t0 = std::chrono::steady_clock::now();
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  EXPECT_EQ(rig.inner().reads_issued(), 0u);
  EXPECT_EQ(check.check(*f, 5s), "");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms);
  ASSERT_TRUE(f->status().is_ok()) << f->status().to_string();
  EXPECT_TRUE(rig.data_ok());
  EXPECT_EQ(e->counters().delayed, 1u);
}

// Every batch dropped: its future fails kTimeout after `timeout`.
FaultConfig dropping(std::chrono::milliseconds timeout) {
  FaultConfig cfg;
  cfg.drop = true;
  cfg.drop_timeout = timeout;
  return cfg;
}

TEST(FaultWrapper, DroppedBatchTimesOutAndWritesNothing) {
  Rig rig;
  auto e = rig.wrap(dropping(300ms));
  ReadChecker check(*rig.local, rig.layout, rig.reads);
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  EXPECT_EQ(check.check(*f, 5s), "");
  EXPECT_EQ(f->status().code(), StatusCode::kTimeout) << f->status().to_string();
  EXPECT_TRUE(check.destination_untouched());
  EXPECT_EQ(rig.inner().reads_issued(), 0u);
  EXPECT_EQ(e->counters().dropped, 1u);
  EXPECT_EQ(e->in_flight(), 0u);
}

TEST(FaultWrapper, DroppedBatchResolvesEarlyWhenCancelled) {
  Rig rig;
  auto e = rig.wrap(dropping(20s));
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  f->cancel();
  ASSERT_TRUE(f->wait_for(5s));
  EXPECT_EQ(f->status().code(), StatusCode::kCancelled);
}

TEST(FaultWrapper, FailAfterNBytesWritesOnlyThePrefixAndFails) {
  Rig rig;
  const std::uint64_t bpt = rig.layout.token_bytes() * rig.layout.num_kv();
  struct Case {
    std::uint64_t n;
    std::vector<KVReadInfo> prefix;  // what may land
  };
  const KVReadInfo& r0 = rig.reads[0];
  const KVReadInfo& r1 = rig.reads[1];
  const std::vector<Case> cases = {
      {0, {}},
      {bpt - 1, {}},
      {3 * bpt, {{r0.layer_idx, r0.local_page_idx, r0.remote_page_idx, 0, 3}}},
      {8 * bpt + 2 * bpt + 5, {r0, {r1.layer_idx, r1.local_page_idx, r1.remote_page_idx, 0, 2}}},
      {rig.batch_bytes(), rig.reads},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("fail after " + std::to_string(c.n) + " bytes");
    FaultConfig cfg;
    cfg.fail_after_bytes = c.n;
    auto e = rig.wrap(cfg);
    ReadChecker check(*rig.local, rig.layout, rig.reads, c.n + 7);
    auto f = e->read_batched_async(rig.info, rig.reads);
    ASSERT_TRUE(f);
    EXPECT_EQ(check.check(*f, 5s), "");
    EXPECT_EQ(f->status().code(), StatusCode::kPeerFailure) << f->status().to_string();
    // No byte beyond the prefix moved ...
    EXPECT_FALSE(check.changed_outside_of(rig.layout, c.prefix).has_value());
    // ... and the prefix did arrive.
    if (!c.prefix.empty()) {
      for (const CopySpan& s : plan_copies(rig.layout, rig.layout, c.prefix).spans) {
        EXPECT_EQ(std::memcmp(rig.local->base() + s.local_offset,
                              rig.remote->base() + s.remote_offset, s.length),
                  0);
      }
    }
    EXPECT_EQ(e->counters().failed_after_bytes, 1u);
  }
}

TEST(FaultWrapper, KillHookRunsAtEachPoint) {
  for (KillPoint point :
       {KillPoint::kBeforeIssue, KillPoint::kAfterIssue, KillPoint::kAfterDelay}) {
    SCOPED_TRACE(static_cast<int>(point));
    Rig rig;
    std::atomic<int> kills{0};
    std::atomic<bool> issued_before_kill{false};
    FaultConfig cfg;
    cfg.kill_point = point;
    cfg.kill_after = 50ms;
    InProcessEngine* inner = nullptr;
    auto e = rig.wrap(cfg, 0ms, [&] {
      if (inner->reads_issued() > 0) issued_before_kill = true;
      kills.fetch_add(1);
    });
    inner = &rig.inner();
    ReadChecker check(*rig.local, rig.layout, rig.reads);
    auto f = e->read_batched_async(rig.info, rig.reads);
    ASSERT_TRUE(f);
    EXPECT_EQ(check.check(*f, 5s), "");
    EXPECT_TRUE(f->status().is_ok());  // killing nobody changes nothing here
    for (int i = 0; i < 500 && kills.load() == 0; ++i) std::this_thread::sleep_for(2ms);
    EXPECT_EQ(kills.load(), 1);
    EXPECT_EQ(e->counters().kills, 1u);
    if (point == KillPoint::kBeforeIssue) {
      EXPECT_FALSE(issued_before_kill.load());
    }
    if (point == KillPoint::kAfterDelay) {
      EXPECT_TRUE(issued_before_kill.load());
    }
  }
}

TEST(FaultWrapper, DuplicateCompletionIsIgnored) {
  Rig rig;
  FaultConfig cfg;
  cfg.duplicate_completion = true;
  auto e = rig.wrap(cfg);
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->get(), rig.batch_bytes());
  for (int i = 0; i < 500 && e->counters().duplicates == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(f->status().is_ok());
  EXPECT_EQ(f->bytes(), rig.batch_bytes());
  EXPECT_EQ(e->counters().duplicates, 1u);
  EXPECT_EQ(e->counters().duplicates_ignored, 1u);

  // A failure followed by a late "success" stays a failure.
  cfg.fail_after_bytes = 0;
  e->set_config(cfg);
  auto g = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(g && g->wait_for(5s));
  for (int i = 0; i < 500 && e->counters().duplicates < 2; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(g->status().code(), StatusCode::kPeerFailure);
  EXPECT_EQ(g->bytes(), 0u);
  EXPECT_EQ(e->counters().duplicates_ignored, 2u);
}

TEST(FaultWrapper, CancelMidFlightStopsWritesBeforeResolving) {
  Rig rig;
  FaultConfig cfg;
  cfg.cancel_after = 15ms;
  auto e = rig.wrap(cfg, /*pause=*/3ms);  // ~20 spans x 3 ms
  ReadChecker check(*rig.local, rig.layout, rig.reads);
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  EXPECT_EQ(check.check(*f, 5s), "");
  EXPECT_EQ(f->status().code(), StatusCode::kCancelled) << f->status().to_string();
  EXPECT_EQ(e->counters().cancels, 1u);
}

TEST(FaultWrapper, CallerCancelIsForwardedToTheInnerEngine) {
  Rig rig;
  auto e = rig.wrap({}, /*pause=*/3ms);
  ReadChecker check(*rig.local, rig.layout, rig.reads);
  auto f = e->read_batched_async(rig.info, rig.reads);
  ASSERT_TRUE(f);
  std::this_thread::sleep_for(10ms);
  f->cancel();
  EXPECT_EQ(check.check(*f, 5s), "");
  EXPECT_EQ(f->status().code(), StatusCode::kCancelled) << f->status().to_string();
}

TEST(FaultWrapper, BadLocalArgumentsThrowBeforeAnythingIsIssued) {
  Rig rig;
  FaultConfig cfg;
  cfg.delay = 10ms;
  auto e = rig.wrap(cfg);
  std::vector<KVReadInfo> bad = rig.reads;
  bad[2].local_page_idx = 16;
  try {
    e->read_batched_async(rig.info, bad);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("local page 16 out of range [0, 16)"),
              std::string::npos);
  }
  bad = rig.reads;
  bad[0].token_end = 9;
  EXPECT_THROW(e->read_batched_async(rig.info, bad), Error);
  // Without a delay, the inner engine's own errors are thrown as they are.
  e->set_config({});
  EXPECT_THROW(e->read_batched_async({"shm", {}}, rig.reads), Error);
  EXPECT_EQ(rig.inner().reads_issued(), 0u);
  EXPECT_EQ(e->in_flight(), 0u);
}

TEST(FaultWrapper, ShutdownResolvesEveryBatchAndRejectsLaterReads) {
  Rig rig;
  auto e = rig.wrap({}, /*pause=*/5ms);
  std::vector<TransferFuture> futures;
  FaultConfig cfg;
  cfg.delay = 20s;
  e->set_config(cfg);
  futures.push_back(*e->read_batched_async(rig.info, rig.reads));  // waits to be issued
  e->set_config(dropping(20s));
  futures.push_back(*e->read_batched_async(rig.info, rig.reads));  // dropped
  e->set_config({});
  futures.push_back(*e->read_batched_async(rig.info, rig.reads));  // in flight, slow
  std::this_thread::sleep_for(10ms);
  const auto t0 = std::chrono::steady_clock::now();
  e->shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  for (const auto& f : futures) {
    ASSERT_TRUE(f.ready());
    EXPECT_EQ(f.status().code(), StatusCode::kShutdown) << f.status().to_string();
  }
  try {
    e->read_batched_async(rig.info, rig.reads);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::kShutdown);
  }
  e->shutdown();  // idempotent
}

// Random faults with these odds (FaultConfig's p_*), at most `max_delay`
// of random delay, dropped batches timing out after `drop_timeout`.
FaultConfig random_faults(double delay, double drop, double fail_after, double kill,
                          double duplicate, double cancel, std::chrono::milliseconds max_delay,
                          std::chrono::milliseconds drop_timeout) {
  FaultConfig cfg;
  cfg.p_delay = delay;
  cfg.p_drop = drop;
  cfg.p_fail_after = fail_after;
  cfg.p_kill = kill;
  cfg.p_duplicate = duplicate;
  cfg.p_cancel = cancel;
  cfg.max_random_delay = max_delay;
  cfg.drop_timeout = drop_timeout;
  return cfg;
}

// Many batches with random faults, one after another: every invariant holds
// after every one, and the same seed draws the same faults.
TEST(FaultWrapper, RandomFaultsKeepEveryInvariant) {
  FaultCounters first;
  for (int run = 0; run < 2; ++run) {
    Rig rig;
    FaultConfig cfg = random_faults(0.15, 0.1, 0.15, 0.1, 0.1, 0.15, 10ms, 50ms);
    cfg.seed = 7;
    std::atomic<int> kills{0};
    auto e = rig.wrap(cfg, /*pause=*/0ms, [&] { kills.fetch_add(1); });
    int ok = 0;
    for (int i = 0; i < 60; ++i) {
      ReadChecker check(*rig.local, rig.layout, rig.reads, i);
      auto f = e->read_batched_async(rig.info, rig.reads);
      ASSERT_TRUE(f);
      ASSERT_EQ(check.check(*f, 5s, 20ms), "") << "batch " << i;
      if (f->status().is_ok()) {
        ++ok;
        EXPECT_TRUE(rig.data_ok()) << "batch " << i;
      }
    }
    e->shutdown();
    const FaultCounters c = e->counters();
    EXPECT_EQ(c.batches, 60u);
    EXPECT_GT(c.total(), 10u);
    EXPECT_GT(ok, 10);
    EXPECT_EQ(c.duplicates, c.duplicates_ignored);
    if (run == 0) {
      first = c;
    } else {
      EXPECT_EQ(c.delayed, first.delayed);
      EXPECT_EQ(c.dropped, first.dropped);
      EXPECT_EQ(c.failed_after_bytes, first.failed_after_bytes);
    }
  }
}

// Several threads pull disjoint pages through one wrapper with random
// faults (for TSan): every future resolves, every success verifies.
TEST(FaultWrapper, ConcurrentCallersWithRandomFaults) {
  KVLayout l = small_layout();
  l.num_pages = 64;
  auto local = KVCache::create_host(l);
  auto remote = KVCache::create_host(l);
  const FaultConfig cfg = random_faults(0.2, 0.05, 0.1, 0, 0.1, 0.1, 5ms, 30ms);
  FaultInjectingEngine e(std::make_unique<InProcessEngine>(local, remote), l, cfg);
  constexpr int kThreads = 4;
  std::atomic<int> unresolved{0}, corrupt{0}, ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::uint32_t> lp, rp;
      for (std::uint32_t i = 0; i < 4; ++i) {
        lp.push_back(static_cast<std::uint32_t>(t * 16 + i * 3));
        rp.push_back(static_cast<std::uint32_t>(63 - t * 16 - i * 2));
      }
      const std::uint64_t seed = 100 + static_cast<std::uint64_t>(t);
      fill_pattern(*remote, seed, rp, 0, 30);
      const auto reads = plan_reads(l, 0, 30, lp, rp);
      for (int i = 0; i < 30; ++i) {
        auto f = e.read_batched_async({"inproc", {}}, reads);
        if (!f->wait_for(5s)) {
          unresolved.fetch_add(1);
          continue;
        }
        if (f->status().is_ok()) {
          ok.fetch_add(1);
          if (!verify_pattern(*local, seed, lp, 0, 30).ok()) corrupt.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  e.shutdown();
  EXPECT_EQ(unresolved.load(), 0);
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_GT(e.counters().total(), 0u);
}

}  // namespace
}  // namespace mstar::kv
