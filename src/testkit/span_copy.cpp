// Copyright mstar-kv authors.
#include "testkit/span_copy.hpp"

#include <algorithm>
#include <cstring>

namespace mstar::kv::testkit {

Partition partition(std::span<const CopySpan> spans, unsigned threads) {
  Partition p;
  std::uint64_t total = 0;
  for (const CopySpan& s : spans) total += s.length;
  p.pieces.reserve(spans.size() + threads);
  p.begin.push_back(0);
  const std::uint64_t share = (total + threads - 1) / std::max(1u, threads);
  std::uint64_t filled = 0;  // bytes given to the current thread
  for (CopySpan s : spans) {
    while (s.length > 0) {
      const std::uint64_t take = std::min(s.length, share - filled);
      p.pieces.push_back({s.local_offset, s.remote_offset, take});
      s.local_offset += take;
      s.remote_offset += take;
      s.length -= take;
      filled += take;
      if (filled == share && p.begin.size() < threads) {
        p.begin.push_back(p.pieces.size());
        filled = 0;
      }
    }
  }
  while (p.begin.size() <= threads) p.begin.push_back(p.pieces.size());
  return p;
}

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

void SpanCopyPool::run(const Partition& p, const RegionMap& dst, const RegionMap& src) {
  internal::UniqueLock lock(mu_);
  job_ = &p;
  dst_ = dst;
  src_ = src;
  pending_ = size();
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
      job = job_;
      dst = dst_;
      src = src_;
    }
    for (std::size_t i = job->begin[idx]; i < job->begin[idx + 1]; ++i) {
      const CopySpan& s = job->pieces[i];
      std::memcpy(dst.pointer(s.local_offset), src.pointer<const std::byte>(s.remote_offset),
                  s.length);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace mstar::kv::testkit
