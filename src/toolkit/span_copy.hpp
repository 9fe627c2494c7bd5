// Copyright mstar-kv authors.
//
// The copy baseline of the bench and the demo: copy spans (planner.hpp)
// from one buffer to another on a fixed number of threads, each thread one
// run of (nearly) equal bytes; and BestCopy, the fastest such copy this
// machine makes, which engines are held against.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv::toolkit {

// The spans cut, for `threads` threads, into kChunksPerThread chunks a
// thread of (nearly) equal bytes, which the threads claim one at a time as
// the engines' copy pools do: on a VM whose cores run at uneven speeds a
// fixed share per thread waits for the slowest, and the baseline would lose
// to the engine it bounds.
struct Partition {
  static constexpr unsigned kChunksPerThread = 8;
  std::vector<CopySpan> pieces;
  std::vector<std::size_t> begin;  // chunk c is pieces [begin[c], begin[c+1])
  unsigned threads = 1;

  unsigned parts() const noexcept { return threads; }
  std::size_t chunks() const noexcept { return begin.size() - 1; }
};
Partition partition(std::span<const CopySpan> spans, unsigned threads);

// How a thread copies its pieces: memcpy, or non-temporal stores four pages
// at a time as the shm engine's large copies do (util/stream_copy.hpp: whole
// destination lines written without being read first, then an sfence;
// memcpy elsewhere than x86-64).
enum class CopyMode { kMemcpy, kStreaming };

// The number of threads, at least 1, that the hardware runs at once: the
// default worker count of the CLI's engines and the most a baseline tries.
unsigned hardware_threads() noexcept;

// A fixed pool of copy threads; run() hands each its part and waits.
// run() is not thread-safe (one caller at a time); the destructor joins.
class SpanCopyPool {
 public:
  explicit SpanCopyPool(unsigned threads);
  ~SpanCopyPool();
  SpanCopyPool(const SpanCopyPool&) = delete;
  SpanCopyPool& operator=(const SpanCopyPool&) = delete;

  unsigned size() const noexcept { return static_cast<unsigned>(threads_.size()); }
  // Copies p's pieces from src + remote offsets to dst + local offsets;
  // returns when all are copied. p may be cut for fewer threads than size():
  // the first p.parts() threads copy, the others stay idle.
  void run(const Partition& p, std::byte* dst, const std::byte* src,
           CopyMode mode = CopyMode::kMemcpy) {
    run(p, RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
        RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)), mode);
  }
  // The same through region maps (caches of one region per layer: a piece
  // lies in one region, as the planner's spans do).
  void run(const Partition& p, const RegionMap& dst, const RegionMap& src,
           CopyMode mode = CopyMode::kMemcpy);

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
  std::atomic<std::size_t> next_chunk_{0};  // the job's next unclaimed chunk
  CopyMode mode_ MSTAR_KV_GUARDED_BY(mu_) = CopyMode::kMemcpy;
  RegionMap dst_ MSTAR_KV_GUARDED_BY(mu_);
  RegionMap src_ MSTAR_KV_GUARDED_BY(mu_);
};

// The thread counts a baseline tries, up to max_threads: every count up to
// 8, then doublings and max_threads itself (memory bandwidth saturates
// within a few threads; trying every count of a large machine would cost
// seconds per case and find nothing new).
std::vector<unsigned> baseline_thread_counts(unsigned max_threads);

// The baseline an engine's copy of the same spans is held against: the
// fastest this machine copies them, so that a ratio to it cannot exceed 1
// but by noise. It tries each thread count of baseline_thread_counts() with
// memcpy and with non-temporal stores (the engines stream large jobs; a
// memcpy of 32 KiB blocks reads every destination line before writing it,
// and would flatter them). One thread is the caller's own; more are a
// pool's, started at construction, outside any timing. Either calibrate()
// once and run() the way it chose (many short timed runs: the bench), or
// run_each() every way each time (few long ones: the demo). Not thread-safe.
class BestCopy {
 public:
  struct Way {
    unsigned threads = 1;
    CopyMode mode = CopyMode::kMemcpy;
  };

  // spans: what each run copies (kept by value). max_threads >= 1.
  BestCopy(std::span<const CopySpan> spans, unsigned max_threads);

  // Copies once in every way, untimed: both sides' pages faulted in, the
  // destination's written, every thread woken once; no timed run then pays a
  // first touch.
  void warm(const RegionMap& dst, const RegionMap& src);
  void warm(std::byte* dst, const std::byte* src) {
    warm(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
         RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)));
  }
  // warm(), then times every way `rounds` times and keeps the fastest.
  // Returns it.
  Way calibrate(const RegionMap& dst, const RegionMap& src, unsigned rounds = 3);
  Way calibrate(std::byte* dst, const std::byte* src, unsigned rounds = 3) {
    return calibrate(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
                     RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)), rounds);
  }
  // One copy the way calibrate() chose (before it: memcpy on one thread);
  // returns the seconds it took.
  double run(const RegionMap& dst, const RegionMap& src);
  double run(std::byte* dst, const std::byte* src) {
    return run(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
               RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)));
  }
  // One copy in every way; returns the fastest one's seconds. way() is then
  // the way that was fastest most often over the run_each() calls. Call
  // warm() first.
  double run_each(const RegionMap& dst, const RegionMap& src);
  double run_each(std::byte* dst, const std::byte* src) {
    return run_each(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(dst)),
                    RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src)));
  }

  Way way() const noexcept { return way_; }
  unsigned max_threads() const noexcept { return counts_.back(); }
  // "memcpy x2" or "nt-copy x2" (non-temporal stores): way().
  std::string name() const;

 private:
  double timed(const Way& w, const RegionMap& dst, const RegionMap& src);

  SpanCopyPool pool_;
  std::vector<unsigned> counts_;
  std::vector<Partition> parts_;  // parts_[i] cut for counts_[i] threads
  std::vector<Way> ways_;         // every count, each with both modes
  std::vector<unsigned> wins_;    // per way: run_each() calls it was fastest in
  Way way_;
};

}  // namespace mstar::kv::toolkit
