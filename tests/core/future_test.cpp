// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "mstar/kv/core/future.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;

TEST(TransferFuture, PollsWaitsAndCarriesBytes) {
  TransferPromise p;
  TransferFuture f = p.future();
  EXPECT_TRUE(f.valid());
  EXPECT_FALSE(f.ready());
  EXPECT_EQ(f.status().code(), StatusCode::kInProgress);
  EXPECT_FALSE(f.wait_for(1ms));
  std::thread t([&] {
    std::this_thread::sleep_for(5ms);
    p.complete(123);
  });
  EXPECT_EQ(f.get(), 123u);
  t.join();
  EXPECT_TRUE(f.ready());
  EXPECT_TRUE(f.status().is_ok());
  EXPECT_EQ(f.bytes(), 123u);
}

TEST(TransferFuture, FirstResolutionWins) {
  TransferPromise p;
  EXPECT_TRUE(p.fail({StatusCode::kTimeout, "read took too long"}));
  EXPECT_FALSE(p.complete(10));
  EXPECT_FALSE(p.fail({StatusCode::kPeerFailure, "x"}));
  auto f = p.future();
  EXPECT_EQ(f.status().code(), StatusCode::kTimeout);
  EXPECT_EQ(f.bytes(), 0u);
  try {
    f.get();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kTimeout);
    EXPECT_STREQ(e.what(), "Timeout: read took too long");
  }
}

TEST(TransferFuture, CancelIsSeenByThePromise) {
  TransferPromise p;
  auto f = p.future();
  EXPECT_FALSE(p.cancel_requested());
  f.cancel();
  EXPECT_TRUE(p.cancel_requested());
  EXPECT_FALSE(f.ready());  // cancel asks; the engine resolves
}

TEST(TransferFuture, DroppingTheFutureIsSafe) {
  TransferPromise p;
  { auto f = p.future(); }
  EXPECT_TRUE(p.complete(1));
  TransferFuture invalid;
  EXPECT_FALSE(invalid.valid());
  EXPECT_FALSE(invalid.ready());
  EXPECT_THROW(invalid.get(), Error);
}

TEST(TransferFuture, ReadyAndFailedHelpers) {
  EXPECT_EQ(make_ready_future(5).get(), 5u);
  EXPECT_EQ(make_failed_future({StatusCode::kCancelled, "c"}).status().code(),
            StatusCode::kCancelled);
}

TEST(TransferFuture, OnResolvedRunsOnceOnTheResolvingThread) {
  TransferPromise p;
  TransferFuture f = p.future();
  std::vector<std::pair<StatusCode, std::uint64_t>> seen;
  std::thread::id ran_on;
  f.on_resolved([&](const Status& s, std::uint64_t bytes) {
    seen.emplace_back(s.code(), bytes);
    ran_on = std::this_thread::get_id();
  });
  f.on_resolved([&](const Status&, std::uint64_t) { throw std::runtime_error("dropped"); });
  EXPECT_TRUE(seen.empty());  // not before resolution
  std::thread t([&] {
    p.complete(77);
    p.fail(Status(StatusCode::kTimeout, "late"));  // ignored: no second call
  });
  const std::thread::id resolver = t.get_id();
  t.join();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].first, StatusCode::kOk);
  EXPECT_EQ(seen[0].second, 77u);
  EXPECT_EQ(ran_on, resolver);
}

TEST(TransferFuture, OnResolvedAfterResolutionRunsOnTheCaller) {
  TransferFuture f = make_failed_future(Status(StatusCode::kPeerFailure, "peer 'a' died"));
  int calls = 0;
  f.on_resolved([&](const Status& s, std::uint64_t bytes) {
    ++calls;
    EXPECT_EQ(s.code(), StatusCode::kPeerFailure);
    EXPECT_EQ(s.message(), "peer 'a' died");
    EXPECT_EQ(bytes, 0u);
  });
  EXPECT_EQ(calls, 1);
  TransferFuture invalid;
  invalid.on_resolved([&](const Status&, std::uint64_t) { ++calls; });
  EXPECT_EQ(calls, 1);
}

// on_resolving runs before any waiter wakes (what stats() after get() sees),
// on_resolved after; one registered after resolution runs at once; neither
// runs twice when a second resolution is refused.
TEST(TransferFuture, OnResolvingRunsBeforeWaitersWake) {
  TransferPromise p;
  TransferFuture f = p.future();
  std::atomic<int> observed{0};
  std::atomic<std::uint64_t> observed_bytes{0};
  f.on_resolving([&](const Status& s, std::uint64_t bytes) {
    EXPECT_TRUE(s.is_ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a slow observer
    observed_bytes = bytes;
    ++observed;
  });
  std::atomic<int> seen_by_waiter{-1};
  std::thread waiter([&] {
    f.wait();
    seen_by_waiter = observed.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the waiter waits
  EXPECT_TRUE(p.complete(7));
  waiter.join();
  EXPECT_EQ(seen_by_waiter.load(), 1) << "a waiter woke before the observer ran";
  EXPECT_EQ(observed_bytes.load(), 7u);
  EXPECT_FALSE(p.fail(Status(StatusCode::kTimeout, "late")));
  EXPECT_EQ(observed.load(), 1);
  int late = 0;
  f.on_resolving([&](const Status& s, std::uint64_t bytes) {
    EXPECT_TRUE(s.is_ok());
    EXPECT_EQ(bytes, 7u);
    ++late;
  });
  EXPECT_EQ(late, 1);
}

TEST(Status, ScopesGroupWhatMustBeTornDown) {
  EXPECT_EQ(Status(StatusCode::kTimeout, "").scope(), FailureScope::kTransfer);
  EXPECT_EQ(Status(StatusCode::kPeerFailure, "").scope(), FailureScope::kPeer);
  EXPECT_EQ(Status(StatusCode::kShutdown, "").scope(), FailureScope::kEngine);
  EXPECT_EQ(Status(StatusCode::kRetryLater, "").scope(), FailureScope::kNone);
}

// Found by an adopter: a promise destroyed unresolved left its future
// waiting forever.
TEST(TransferFuture, PromiseDestroyedUnresolvedResolvesTheFuture) {
  TransferFuture f;
  {
    TransferPromise p;
    f = p.future();
    TransferPromise copy = p;  // copies share the state: only the last one counts
    { TransferPromise moved = std::move(copy); }
    EXPECT_FALSE(f.ready());
  }
  ASSERT_TRUE(f.wait_for(std::chrono::seconds(5)));
  EXPECT_EQ(f.status().code(), StatusCode::kInternal);
  EXPECT_NE(f.status().message().find("engine dropped the read"), std::string::npos);
  TransferFuture done;
  {
    TransferPromise p;
    done = p.future();
    p.complete(7);
  }
  EXPECT_EQ(done.get(), 7u);  // a resolved promise is left as it is
}

}  // namespace
}  // namespace mstar::kv
