// Copyright mstar-kv authors.
//
// Staging (src/core/staging.hpp): an owner's GatherPipeline and a reader's
// ScatterPipeline joined by a simulated wire that delays and reorders
// messages, over copiers whose jobs finish only after some polls (and
// write their bytes only then, as a device copy does), with the planner's
// plans between caches of different geometry: byte-exact against memcpy of
// the plan, never more buffers in flight than given, messages handed over
// in order, and the failure paths (a gather or scatter that fails, a lost
// receive, a message twice or out of range, abort): a pipeline that failed
// or was aborted writes nothing once idle() says so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>
#include <random>
#include <vector>

#include "common/layouts.hpp"
#include "core/staging.hpp"
#include "mstar/kv/core/planner.hpp"

namespace mstar::kv::staging {
namespace {

// A copier whose jobs do their copy (host memcpy) only when polled the
// n-th time, n random in [1, max_delay] (so later jobs may finish first),
// and fail instead when they are the `fail_at`-th job.
// The region map of a cache of one region at `p`.
RegionMap at(const void* p) { return RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(p)); }

class SlowCopier final : public Copier {
 public:
  SlowCopier(int max_delay, int fail_at = -1) : max_delay_(max_delay), fail_at_(fail_at) {}
  std::unique_ptr<Buffer> allocate(std::size_t bytes) override {
    ++buffers;
    return host_->allocate(bytes);
  }
  std::unique_ptr<Job> gather(const RegionMap& base, std::span<const StridedSpan> spans,
                              Buffer& into) override {
    return start([=, this, &into] { (void)host_->gather(base, spans, into); });
  }
  std::unique_ptr<Job> scatter(const Buffer& from, std::span<const StridedSpan> spans,
                               const RegionMap& base) override {
    return start([=, this, &from] { (void)host_->scatter(from, spans, base); });
  }
  int running = 0;
  int max_running = 0;
  int buffers = 0;
  int jobs = 0;

 private:
  class SlowJob final : public Job {
   public:
    SlowJob(SlowCopier* c, std::function<void()> copy, int polls, bool fails)
        : c_(c), copy_(std::move(copy)), polls_(polls), fails_(fails) {}
    std::optional<Status> poll() override {
      if (!done_ && --polls_ <= 0) finish();
      if (!done_) return std::nullopt;
      return status_;
    }
    Status wait() override {
      if (!done_) finish();
      return status_;
    }

   private:
    void finish() {
      if (!fails_) copy_();
      status_ = fails_ ? Status(StatusCode::kInternal, "injected copy failure") : Status::ok();
      done_ = true;
      --c_->running;
    }
    SlowCopier* c_;
    std::function<void()> copy_;
    int polls_;
    bool fails_;
    bool done_ = false;
    Status status_;
  };
  std::unique_ptr<Job> start(std::function<void()> copy) {
    ++running;
    max_running = std::max(max_running, running);
    const bool fails = jobs++ == fail_at_;
    const int delay = 1 + static_cast<int>(rng_() % static_cast<std::uint64_t>(max_delay_));
    return std::make_unique<SlowJob>(this, std::move(copy), delay, fails);
  }
  std::shared_ptr<Copier> host_ = host_copier();
  std::mt19937_64 rng_{17};
  int max_delay_;
  int fail_at_;
};

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(g() & 0xFF);
  return v;
}

struct Plan {
  KVLayout local;
  KVLayout remote;
  std::vector<StridedSpan> spans;
};

// TP 1 -> 2 from 16-token HND pages into 64-token NHD pages, in the given
// cache orders, tokens [start, 300).
Plan plan_of(CacheOrder lco, CacheOrder rco, std::uint64_t start = 0) {
  const KVLayout remote = testing::shard_layout(16, 8, 0, 8, PageOrder::kHND, rco, 64);
  const KVLayout local = testing::shard_layout(64, 4, 4, 8, PageOrder::kNHD, lco, 16);
  std::vector<std::uint32_t> lp(5);
  std::vector<std::uint32_t> rp(19);
  for (std::uint32_t i = 0; i < lp.size(); ++i) lp[i] = (i * 7 + 3) % 16;
  for (std::uint32_t i = 0; i < rp.size(); ++i) rp[i] = (i * 11 + 5) % 64;
  const auto reads = plan_reads(local, remote, start, 300, lp, rp);
  return {local, remote, plan_strided_copies(local, remote, reads).spans};
}

struct Outcome {
  std::vector<std::byte> local;
  Status owner;
  Status reader;
  bool finished = false;
};

// Runs one read through both pipelines over a wire that holds each message
// for a random number of rounds (so they arrive out of order); a message
// that finds no reader buffer waits on the wire.
Outcome transfer(const Plan& p, const std::vector<std::byte>& remote, SlowCopier& oc,
                 SlowCopier& rc, std::size_t buffers, std::uint64_t max_bytes, std::uint64_t seed,
                 int abort_after_round = -1) {
  Outcome out;
  out.local.assign(p.local.total_bytes(), std::byte{0xEE});
  const auto messages = split_messages(p.spans, max_bytes, 64);
  std::shared_ptr<Copier> owner_copier(&oc, [](Copier*) {});
  std::shared_ptr<Copier> reader_copier(&rc, [](Copier*) {});
  GatherPipeline g(owner_copier, at(remote.data()), p.spans, messages, buffers);
  ScatterPipeline s(reader_copier, at(out.local.data()), p.spans, messages, buffers);
  struct InFlight {
    std::size_t index;
    std::vector<std::byte> bytes;
    int rounds;
  };
  std::deque<InFlight> wire;
  std::mt19937_64 rng(seed);
  std::size_t expect_next = 0;
  bool aborted = false;
  for (int round = 0; round < 100000; ++round) {
    if (round == abort_after_round) {
      g.abort();
      s.abort();
      aborted = true;
    }
    while (auto r = g.poll()) {
      EXPECT_EQ(r->index, expect_next++) << "handed over out of order";
      wire.push_back({r->index, std::vector<std::byte>(r->data, r->data + r->bytes),
                      static_cast<int>(rng() % 4)});
      g.sent(r->index);  // the wire copied it: the send completed
    }
    // Deliver what is due, in a random order.
    std::shuffle(wire.begin(), wire.end(), rng);
    for (auto it = wire.begin(); it != wire.end();) {
      if (it->rounds-- > 0) {
        ++it;
        continue;
      }
      Buffer* b = s.receive_into(it->index);
      if (b == nullptr) {
        ++it;  // no buffer free (or the reader stopped): stays on the wire
        continue;
      }
      EXPECT_GE(b->size(), it->bytes.size());
      std::memcpy(b->data(), it->bytes.data(), it->bytes.size());
      s.received(it->index);
      it = wire.erase(it);
    }
    s.poll();
    EXPECT_LE(oc.running, static_cast<int>(buffers));
    EXPECT_LE(rc.running, static_cast<int>(buffers));
    const bool failed = !g.status().is_ok() || !s.status().is_ok();
    const bool done = (g.finished() && s.finished() && wire.empty()) || failed || aborted;
    if (done && g.idle() && s.idle()) break;
  }
  out.owner = g.status();
  out.reader = s.status();
  out.finished = s.finished();
  return out;
}

std::vector<std::byte> reference(const Plan& p, const std::vector<std::byte>& remote) {
  std::vector<std::byte> want(p.local.total_bytes(), std::byte{0xEE});
  for (const StridedSpan& s : p.spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      std::memcpy(want.data() + s.local_offset + r * s.local_stride,
                  remote.data() + s.remote_offset + r * s.remote_stride, s.length);
    }
  }
  return want;
}

TEST(Staging, PipelinesMoveThePlanByteExactWithBoundedBuffers) {
  for (CacheOrder lco : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor}) {
    for (CacheOrder rco : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor}) {
      const Plan p = plan_of(lco, rco, 37);
      const auto remote = random_bytes(p.remote.total_bytes(), 9);
      for (std::size_t buffers : {1u, 2u, 3u}) {
        for (std::uint64_t max_bytes :
             {std::uint64_t{1}, std::uint64_t{4096}, std::uint64_t{1} << 20}) {
          SCOPED_TRACE(std::to_string(buffers) + " buffers, messages of " +
                       std::to_string(max_bytes) + " bytes");
          SlowCopier oc(3);
          SlowCopier rc(2);
          const Outcome o =
              transfer(p, remote, oc, rc, buffers, max_bytes, buffers * 31 + max_bytes);
          EXPECT_TRUE(o.owner.is_ok()) << o.owner.to_string();
          EXPECT_TRUE(o.reader.is_ok()) << o.reader.to_string();
          EXPECT_TRUE(o.finished);
          EXPECT_TRUE(o.local == reference(p, remote)) << "bytes differ from memcpy of the plan";
          const int msgs = static_cast<int>(split_messages(p.spans, max_bytes, 64).size());
          EXPECT_EQ(oc.buffers, std::min<int>(static_cast<int>(buffers), msgs));
          EXPECT_EQ(rc.buffers, std::min<int>(static_cast<int>(buffers), msgs));
          if (buffers > 1 && msgs > 1) {
            EXPECT_GT(oc.max_running, 1) << "gathers never overlapped (no double buffering)";
          }
        }
      }
    }
  }
}

TEST(Staging, AFailedGatherFailsTheReadAndSendsNothingAfter) {
  const Plan p = plan_of(CacheOrder::kLayerMajor, CacheOrder::kPageMajor);
  const auto remote = random_bytes(p.remote.total_bytes(), 4);
  SlowCopier oc(2, /*fail_at=*/3);
  SlowCopier rc(1);
  const Outcome o = transfer(p, remote, oc, rc, 2, 2048, 5);
  EXPECT_EQ(o.owner.code(), StatusCode::kInternal) << o.owner.to_string();
  EXPECT_NE(o.owner.message().find("injected"), std::string::npos);
  EXPECT_FALSE(o.finished);
  EXPECT_EQ(oc.running, 0) << "a gather still running after the pipeline went idle";
}

TEST(Staging, AFailedScatterFailsTheReadAndWritesNothingAfterIdle) {
  const Plan p = plan_of(CacheOrder::kPageMajor, CacheOrder::kLayerMajor);
  const auto remote = random_bytes(p.remote.total_bytes(), 6);
  SlowCopier oc(1);
  SlowCopier rc(3, /*fail_at=*/2);
  const Outcome o = transfer(p, remote, oc, rc, 2, 2048, 7);
  EXPECT_TRUE(o.owner.is_ok());
  EXPECT_EQ(o.reader.code(), StatusCode::kInternal) << o.reader.to_string();
  EXPECT_FALSE(o.finished);
  EXPECT_EQ(rc.running, 0);
}

TEST(Staging, AbortStopsBothSidesOnceTheirCopiesDrain) {
  const Plan p = plan_of(CacheOrder::kLayerMajor, CacheOrder::kLayerMajor);
  const auto remote = random_bytes(p.remote.total_bytes(), 8);
  SlowCopier oc(4);
  SlowCopier rc(4);
  const Outcome o = transfer(p, remote, oc, rc, 2, 1024, 9, /*abort_after_round=*/3);
  EXPECT_FALSE(o.finished);
  EXPECT_EQ(oc.running, 0);
  EXPECT_EQ(rc.running, 0);
  // What landed is the plan's bytes or the sentinel, nothing else.
  const auto want = reference(p, remote);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    bad += o.local[i] != want[i] && o.local[i] != std::byte{0xEE};
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Staging, TheReaderRefusesMessagesItDidNotAskForOrGotTwice) {
  const Plan p = plan_of(CacheOrder::kLayerMajor, CacheOrder::kLayerMajor);
  std::vector<std::byte> local(p.local.total_bytes());
  const auto messages = split_messages(p.spans, 4096, 64);
  ASSERT_GE(messages.size(), 2u);
  {
    ScatterPipeline s(host_copier(), at(local.data()), p.spans, messages, 2);
    EXPECT_EQ(s.receive_into(messages.size()), nullptr);
    EXPECT_NE(s.status().message().find("not part of the read"), std::string::npos);
  }
  {
    ScatterPipeline s(host_copier(), at(local.data()), p.spans, messages, 2);
    ASSERT_NE(s.receive_into(0), nullptr);
    s.received(0);
    s.poll();
    EXPECT_EQ(s.receive_into(0), nullptr);
    EXPECT_NE(s.status().message().find("arrived twice"), std::string::npos);
    EXPECT_EQ(s.receive_into(1), nullptr) << "a failed pipeline takes no more";
  }
  {
    ScatterPipeline s(host_copier(), at(local.data()), p.spans, messages, 1);
    ASSERT_NE(s.receive_into(1), nullptr);
    EXPECT_EQ(s.receive_into(0), nullptr) << "one buffer, busy";
    EXPECT_TRUE(s.status().is_ok());
    s.lost(1, Status(StatusCode::kPeerFailure, "receive failed"));
    EXPECT_EQ(s.status().code(), StatusCode::kPeerFailure);
  }
}

TEST(Staging, MessagesSplitByBytesAndSpansAndAreChecked) {
  const std::vector<StridedSpan> spans{{0, 0, 10, 1, 0, 0},
                                       {0, 0, 10, 3, 20, 20},
                                       {0, 0, 100, 1, 0, 0},
                                       {0, 0, 5, 1, 0, 0},
                                       {0, 0, 5, 1, 0, 0}};
  const auto m = split_messages(spans, 40, 2);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].count, 2u);  // 10 + 30
  EXPECT_EQ(m[0].bytes, 40u);
  EXPECT_EQ(m[1].count, 1u);  // 100: alone
  EXPECT_EQ(m[2].count, 2u);
  EXPECT_EQ(m[2].bytes, 10u);
  std::vector<std::byte> cache(512);
  std::vector<Message> bad = m;
  bad[1].bytes = 99;
  try {
    GatherPipeline g(host_copier(), at(cache.data()), spans, bad, 2);
    ADD_FAILURE() << "a message that does not match its spans was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("staging message 1"), std::string::npos) << e.what();
  }
  try {
    ScatterPipeline s(host_copier(), at(cache.data()), spans, m, 0);
    ADD_FAILURE() << "zero buffers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace mstar::kv::staging
