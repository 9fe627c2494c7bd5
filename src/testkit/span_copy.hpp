// Copyright mstar-kv authors.
//
// The memcpy baseline of the bench and the demo: copy spans (planner.hpp)
// from one buffer to another on a fixed number of threads, each thread one
// run of (nearly) equal bytes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "mstar/kv/planner.hpp"
#include "mstar/kv/regions.hpp"
#include "mstar/kv/thread_annotations.hpp"

namespace mstar::kv::testkit {

// The spans cut into `threads` runs of (nearly) equal bytes.
struct Partition {
  std::vector<CopySpan> pieces;
  std::vector<std::size_t> begin;  // thread t copies pieces [begin[t], begin[t+1])
};
Partition partition(std::span<const CopySpan> spans, unsigned threads);

// A fixed pool of copy threads; run() hands each its part and waits.
// run() is not thread-safe (one caller at a time); the destructor joins.
class SpanCopyPool {
 public:
  explicit SpanCopyPool(unsigned threads);
  ~SpanCopyPool();
  SpanCopyPool(const SpanCopyPool&) = delete;
  SpanCopyPool& operator=(const SpanCopyPool&) = delete;

  unsigned size() const noexcept { return static_cast<unsigned>(threads_.size()); }
  // Copies p's pieces (cut for size() threads) from src + remote offsets to
  // dst + local offsets; returns when all are copied.
  void run(const Partition& p, std::byte* dst, const std::byte* src) {
    run(p, RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
        RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)));
  }
  // The same through region maps (caches of one region per layer: a piece
  // lies in one region, as the planner's spans do).
  void run(const Partition& p, const RegionMap& dst, const RegionMap& src);

 private:
  void work(unsigned idx);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  std::uint64_t generation_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  unsigned pending_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  bool stop_ MSTAR_KV_GUARDED_BY(mu_) = false;
  const Partition* job_ MSTAR_KV_GUARDED_BY(mu_) = nullptr;
  RegionMap dst_ MSTAR_KV_GUARDED_BY(mu_);
  RegionMap src_ MSTAR_KV_GUARDED_BY(mu_);
};

}  // namespace mstar::kv::testkit
