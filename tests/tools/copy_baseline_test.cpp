// Copyright mstar-kv authors.
//
// The copy baseline of `mstar-kv demo` and `bench` (src/toolkit/span_copy.hpp):
// every way it tries (memcpy and non-temporal stores, on the caller's thread
// and on pools cut for fewer threads than they have) copies exactly the
// spans named, and it tries the thread counts it says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mstar/kv/util/status.hpp"
#include "toolkit/span_copy.hpp"

namespace mstar::kv::toolkit {
namespace {

constexpr std::byte kSentinel{0xA5};

// Spans of odd lengths and alignments, runs of several pages among them,
// scattered in both buffers, with gaps left untouched.
struct Case {
  std::vector<CopySpan> spans;
  std::vector<std::byte> src;
  std::vector<std::byte> want;  // dst after a correct copy
};

Case make_case() {
  Case c;
  std::uint64_t local = 3;
  std::uint64_t remote = 7;
  for (std::uint64_t length : {1ull, 63ull, 64ull, 4096ull, 16385ull, 70000ull, 200ull, 65536ull}) {
    c.spans.push_back({local, remote, length});
    local += length + 129;
    remote += length + 4111;
  }
  std::reverse(c.spans.begin(), c.spans.end());  // remote offsets descending: out of order
  c.src.resize(remote);
  for (std::uint64_t i = 0; i < remote; ++i) c.src[i] = std::byte(i * 131 + 7);
  c.want.assign(local + 64, kSentinel);
  for (const CopySpan& s : c.spans) {
    for (std::uint64_t b = 0; b < s.length; ++b)
      c.want[s.local_offset + b] = c.src[s.remote_offset + b];
  }
  return c;
}

std::uint64_t differing(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

TEST(CopyBaseline, EveryWayCopiesExactlyTheSpans) {
  const Case c = make_case();
  BestCopy best(c.spans, 4);
  EXPECT_EQ(best.max_threads(), 4u);
  std::vector<std::byte> dst(c.want.size(), kSentinel);
  best.warm(dst.data(), c.src.data());  // every way, each over the last one's bytes
  EXPECT_EQ(differing(dst, c.want), 0u);
  for (int i = 0; i < 3; ++i) {
    std::fill(dst.begin(), dst.end(), kSentinel);
    EXPECT_GT(best.run_each(dst.data(), c.src.data()), 0.0);
    EXPECT_EQ(differing(dst, c.want), 0u) << "run_each " << i;
  }
  std::fill(dst.begin(), dst.end(), kSentinel);
  const BestCopy::Way w = best.calibrate(dst.data(), c.src.data(), 1);
  EXPECT_GE(w.threads, 1u);
  EXPECT_LE(w.threads, 4u);
  std::fill(dst.begin(), dst.end(), kSentinel);
  EXPECT_GT(best.run(dst.data(), c.src.data()), 0.0);
  EXPECT_EQ(differing(dst, c.want), 0u) << best.name();
}

TEST(CopyBaseline, PoolRunsJobsCutForFewerThreadsThanItHas) {
  const Case c = make_case();
  SpanCopyPool pool(4);
  std::vector<std::byte> dst(c.want.size());
  // Alternating sizes: a thread idle in one job (or waking after it ended)
  // must still take its part of the next.
  for (int i = 0; i < 50; ++i) {
    const unsigned threads = 1 + static_cast<unsigned>(i % 4);
    const Partition p = partition(c.spans, threads);
    ASSERT_EQ(p.parts(), threads);
    std::fill(dst.begin(), dst.end(), kSentinel);
    pool.run(p, dst.data(), c.src.data(), i % 2 ? CopyMode::kStreaming : CopyMode::kMemcpy);
    ASSERT_EQ(differing(dst, c.want), 0u) << threads << " threads";
  }
  try {
    pool.run(partition(c.spans, 5), dst.data(), c.src.data());
    FAIL() << "a job for 5 threads ran on a pool of 4";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("5 threads"), std::string::npos) << e.what();
  }
}

TEST(CopyBaseline, PartitionCutsEqualChunksTheThreadsClaim) {
  const Case c = make_case();
  std::uint64_t total = 0;
  for (const CopySpan& s : c.spans) total += s.length;
  for (unsigned threads : {1u, 2u, 3u, 7u}) {
    const Partition p = partition(c.spans, threads);
    const std::uint64_t chunks = std::uint64_t{threads} * Partition::kChunksPerThread;
    const std::uint64_t share = (total + chunks - 1) / chunks;
    ASSERT_EQ(p.parts(), threads);
    // At most one chunk a share (a ceiling: the last may come out short or
    // not at all), and never fewer chunks than threads.
    ASSERT_LE(p.chunks(), chunks) << threads << " threads";
    ASSERT_GE(p.chunks(), threads) << threads << " threads";
    std::uint64_t seen = 0;
    for (std::size_t k = 0; k < p.chunks(); ++k) {
      std::uint64_t bytes = 0;
      for (std::size_t i = p.begin[k]; i < p.begin[k + 1]; ++i) bytes += p.pieces[i].length;
      EXPECT_LE(bytes, share) << "chunk " << k << " of " << threads << " threads";
      EXPECT_GT(bytes, 0u) << "chunk " << k << " of " << threads << " threads";
      seen += bytes;
    }
    EXPECT_EQ(seen, total);
  }
  EXPECT_EQ(partition({}, 4).chunks(), 0u);
}

TEST(CopyBaseline, ThreadCountsCoverEveryCountUpToEightThenDoublings) {
  using V = std::vector<unsigned>;
  EXPECT_EQ(baseline_thread_counts(0), V({1}));
  EXPECT_EQ(baseline_thread_counts(1), V({1}));
  EXPECT_EQ(baseline_thread_counts(2), V({1, 2}));
  EXPECT_EQ(baseline_thread_counts(8), V({1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(baseline_thread_counts(20), V({1, 2, 3, 4, 5, 6, 7, 8, 16, 20}));
  EXPECT_EQ(baseline_thread_counts(64), V({1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64}));
  EXPECT_GE(hardware_threads(), 1u);
}

}  // namespace
}  // namespace mstar::kv::toolkit
