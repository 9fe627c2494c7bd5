// Copyright mstar-kv authors.
#include "toolkit/span_copy.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>

#include "mstar/kv/util/status.hpp"
#include "util/stream_copy.hpp"

namespace mstar::kv::toolkit {

Partition partition(std::span<const CopySpan> spans, unsigned threads) {
  Partition p;
  p.threads = std::max(1u, threads);
  const std::uint64_t chunks = std::uint64_t{p.threads} * Partition::kChunksPerThread;
  std::uint64_t total = 0;
  for (const CopySpan& s : spans) total += s.length;
  p.pieces.reserve(spans.size() + chunks);
  p.begin.push_back(0);
  const std::uint64_t share = std::max<std::uint64_t>(1, (total + chunks - 1) / chunks);
  std::uint64_t filled = 0;  // bytes in the current chunk
  for (CopySpan s : spans) {
    while (s.length > 0) {
      const std::uint64_t take = std::min(s.length, share - filled);
      p.pieces.push_back({s.local_offset, s.remote_offset, take});
      s.local_offset += take;
      s.remote_offset += take;
      s.length -= take;
      filled += take;
      if (filled == share) {
        p.begin.push_back(p.pieces.size());
        filled = 0;
      }
    }
  }
  if (p.begin.back() != p.pieces.size()) p.begin.push_back(p.pieces.size());
  return p;
}

namespace {

// Pieces [begin, end) of p, the way `mode` says.
void copy_pieces(const Partition& p, std::size_t begin, std::size_t end, const RegionMap& dst,
                 const RegionMap& src, CopyMode mode) {
  for (std::size_t i = begin; i < end; ++i) {
    const CopySpan& s = p.pieces[i];
    std::byte* d = dst.pointer(s.local_offset);
    const std::byte* r = src.pointer<const std::byte>(s.remote_offset);
    if (mode == CopyMode::kStreaming) {
      detail::stream_copy_pages(d, r, s.length);
    } else {
      std::memcpy(d, r, s.length);
    }
  }
  // The streamed lines reach memory before the copy is reported done.
  if (mode == CopyMode::kStreaming) detail::stream_fence();
}

}  // namespace

unsigned hardware_threads() noexcept { return std::max(1u, std::thread::hardware_concurrency()); }

SpanCopyPool::SpanCopyPool(unsigned threads) {
  for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this, i] { work(i); });
}

SpanCopyPool::~SpanCopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void SpanCopyPool::run(const Partition& p, const RegionMap& dst, const RegionMap& src,
                       CopyMode mode) {
  if (p.parts() == 0) return;
  if (p.parts() > size()) {
    throw Error(StatusCode::kInvalidArgument, "a partition for " + std::to_string(p.parts()) +
                                                  " threads, the pool has " +
                                                  std::to_string(size()));
  }
  internal::UniqueLock lock(mu_);
  job_ = &p;
  mode_ = mode;
  dst_ = dst;
  src_ = src;
  pending_ = p.parts();
  next_chunk_.store(0, std::memory_order_relaxed);
  ++generation_;
  start_cv_.notify_all();
  done_cv_.wait(lock, [this] {
    MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
    return pending_ == 0;
  });
  job_ = nullptr;
}

void SpanCopyPool::work(unsigned idx) {
  std::uint64_t seen = 0;
  for (;;) {
    const Partition* job = nullptr;
    CopyMode mode = CopyMode::kMemcpy;
    RegionMap dst;
    RegionMap src;
    {
      internal::UniqueLock lock(mu_);
      start_cv_.wait(lock, [&] {
        MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
        return stop_ || generation_ != seen;
      });
      if (stop_) return;
      seen = generation_;
      // Not this thread's: a job cut for fewer threads, or one that ended
      // before this thread woke.
      if (job_ == nullptr || idx >= job_->parts()) continue;
      job = job_;
      mode = mode_;
      dst = dst_;
      src = src_;
    }
    for (std::size_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed); c < job->chunks();
         c = next_chunk_.fetch_add(1, std::memory_order_relaxed)) {
      copy_pieces(*job, job->begin[c], job->begin[c + 1], dst, src, mode);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

std::vector<unsigned> baseline_thread_counts(unsigned max_threads) {
  max_threads = std::max(1u, max_threads);
  std::vector<unsigned> counts;
  for (unsigned t = 1; t <= std::min(max_threads, 8u); ++t) counts.push_back(t);
  for (unsigned t = 16; t < max_threads; t *= 2) counts.push_back(t);
  if (counts.back() != max_threads) counts.push_back(max_threads);
  return counts;
}

// One thread copies on the caller's: the pool is for two and more.
BestCopy::BestCopy(std::span<const CopySpan> spans, unsigned max_threads)
    : pool_(max_threads > 1 ? max_threads : 0), counts_(baseline_thread_counts(max_threads)) {
  parts_.reserve(counts_.size());
  for (unsigned t : counts_) {
    parts_.push_back(partition(spans, t));
    for (CopyMode m : {CopyMode::kMemcpy, CopyMode::kStreaming}) ways_.push_back({t, m});
  }
  wins_.assign(ways_.size(), 0);
}

double BestCopy::timed(const Way& w, const RegionMap& dst, const RegionMap& src) {
  const auto at = std::find(counts_.begin(), counts_.end(), w.threads);
  const Partition& p = parts_[static_cast<std::size_t>(at - counts_.begin())];
  const auto t0 = std::chrono::steady_clock::now();
  if (w.threads == 1) {
    // On the calling thread: a small copy is done before a pool thread
    // would have woken, and the engines copy small reads inline too.
    copy_pieces(p, 0, p.pieces.size(), dst, src, w.mode);
  } else {
    pool_.run(p, dst, src, w.mode);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void BestCopy::warm(const RegionMap& dst, const RegionMap& src) {
  for (const Way& w : ways_) timed(w, dst, src);
}

BestCopy::Way BestCopy::calibrate(const RegionMap& dst, const RegionMap& src, unsigned rounds) {
  warm(dst, src);
  std::vector<double> best(ways_.size(), std::numeric_limits<double>::infinity());
  // Round by round rather than way by way: a burst of load on a shared
  // machine then slows one round of every way, not every round of one.
  for (unsigned r = 0; r < std::max(1u, rounds); ++r) {
    for (std::size_t i = 0; i < ways_.size(); ++i) {
      best[i] = std::min(best[i], timed(ways_[i], dst, src));
    }
  }
  way_ = ways_[static_cast<std::size_t>(std::min_element(best.begin(), best.end()) - best.begin())];
  return way_;
}

double BestCopy::run(const RegionMap& dst, const RegionMap& src) { return timed(way_, dst, src); }

double BestCopy::run_each(const RegionMap& dst, const RegionMap& src) {
  double best = std::numeric_limits<double>::infinity();
  std::size_t fastest = 0;
  for (std::size_t i = 0; i < ways_.size(); ++i) {
    const double s = timed(ways_[i], dst, src);
    if (s < best) {
      best = s;
      fastest = i;
    }
  }
  ++wins_[fastest];
  way_ =
      ways_[static_cast<std::size_t>(std::max_element(wins_.begin(), wins_.end()) - wins_.begin())];
  return best;
}

std::string BestCopy::name() const {
  return std::string(way_.mode == CopyMode::kStreaming ? "nt-copy x" : "memcpy x") +
         std::to_string(way_.threads);
}

}  // namespace mstar::kv::toolkit
