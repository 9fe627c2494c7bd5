// Copyright mstar-kv authors.
//
// CudaIpcKVTransferEngine::Impl (internal to the engine): its remote
// mappings, streams and reads in flight. Its methods are defined by
// responsibility:
//   cuda_ipc_engine.cpp  construction, reads, completion, shutdown, the API
//   cuda_ipc_remote.cpp  opening owners' allocations (generations, lineages)
//   cuda_ipc_copy.cpp    enqueuing copies on the streams, page epoch checks
//   cuda_ipc_kernel.cpp  a read as one launch of the copy kernel (span_kernel.hpp)
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_epochs.hpp"
#include "cuda_util.hpp"
#include "device_memory.hpp"
#include "engines/engine_makers.hpp"
#include "engines/option_keys.hpp"
#include "host_tables.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/util/status.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "span_kernel.hpp"

namespace mstar::kv {

namespace cuda_ipc_detail {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMaxStreams = 64;
constexpr auto kMinBackoff = std::chrono::microseconds(20);
constexpr auto kMaxBackoff = std::chrono::microseconds(1000);
// Copies per cudaMemcpyBatchAsync call: bounds the host arrays built per call.
constexpr std::size_t kBatchChunk = 4096;
// Span table slots kept for reuse (pinned + device blocks, kernel copies).
constexpr std::size_t kMaxFreeSlots = 8;
// Generations remembered as replaced, per engine (oldest forgotten first).
constexpr std::size_t kMaxRetired = 4096;

inline std::string gen_string(std::uint32_t pid, std::uint64_t gen) {
  return "pid " + std::to_string(pid) + " generation " + std::to_string(gen);
}

// One remote allocation opened with cudaIpcOpenMemHandle. RAII: the
// destructor closes the handle, so the last reference must be dropped only
// once no copy that uses the mapping can still run (the engine holds one
// reference in its cache and one per read in flight, released after the
// read's copies drained).
class RemoteMapping {
 public:
  RemoteMapping(void* base, int device) : base_(static_cast<std::byte*>(base)), device_(device) {}
  ~RemoteMapping() {
    try {
      cuda_ipc::DeviceGuard guard(device_);
      if (cudaIpcCloseMemHandle(base_) != cudaSuccess) (void)cudaGetLastError();
      if (epochs_ != nullptr && cudaIpcCloseMemHandle(epochs_) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    } catch (const Error&) {
    }
  }
  RemoteMapping(const RemoteMapping&) = delete;
  RemoteMapping& operator=(const RemoteMapping&) = delete;

  std::byte* base() const noexcept { return base_; }
  // The owner's device page epoch table, opened with the cache (null when
  // its descriptor has none).
  const std::uint64_t* epochs() const noexcept { return epochs_; }
  void set_epochs(void* p) noexcept { epochs_ = static_cast<std::uint64_t*>(p); }

 private:
  std::byte* base_;
  int device_;
  std::uint64_t* epochs_ = nullptr;
};

}  // namespace cuda_ipc_detail

class CudaIpcKVTransferEngine::Impl {
 public:
  using Clock = cuda_ipc_detail::Clock;
  using RemoteMapping = cuda_ipc_detail::RemoteMapping;

 private:
 public:
  Impl(std::shared_ptr<KVCache> cache, const EngineOptions& options);
  ~Impl() { shutdown(); }

  const CudaIpcKVTransferInfo& info() const noexcept { return info_; }
  const KVTransferInfo& encoded() const noexcept { return encoded_; }
  std::optional<TransferFuture> read(const RemoteCache& remote, std::span<const KVReadInfo> reads);
  void shutdown();
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> reads);
  const KVLayout& layout() const noexcept { return cache_->layout(); }
  bool kernel() const noexcept { return kernel_; }
  std::size_t open_handles() const {
    std::lock_guard lk(map_mu_);
    return mappings_.size();
  }

 private:
  struct Read {
    TransferPromise promise;
    std::vector<cudaEvent_t> events;             // one per stream used
    std::unique_ptr<cuda_ipc::TableSlot> table;  // kernel copies: its span table
    std::shared_ptr<RemoteMapping> mapping;      // null when reading our own cache
    std::uint64_t bytes = 0;
    std::size_t spans = 0;
    Clock::time_point start;
    Clock::time_point deadline;
    bool timed_out = false;  // seen unfinished past its deadline
    bool cancelled = false;  // seen unfinished with cancel requested
    cudaError_t error = cudaSuccess;
    // Page epochs: with epoch != 0, `pages` must carry it in the owner's
    // table after the copies as they did before (resolve checks).
    std::uint64_t epoch = 0;
    std::vector<std::uint32_t> pages;
    std::uint32_t epoch_pages = 0;
  };
  // The epoch check of `r`'s pages against the owner's table, `when`.
  Status check_epochs(const Read& r, std::string_view when, bool after_copy);

  // The mapping for `remote`, opened now if needed. Throws Error: for
  // stale / dead / unreachable owners, and kPeerFailure when CUDA fails to
  // open a reachable owner's memory (the caller delivers that one through
  // the read's future, as a transfer failure).
  std::shared_ptr<RemoteMapping> acquire(const CudaIpcKVTransferInfo& remote);
  // Enqueues every span and records the events into `read`. On a CUDA
  // failure, waits for what was enqueued and returns the error.
  Status enqueue(const std::vector<CopySpan>& spans, const std::vector<StridedSpan>& strided,
                 const std::byte* src, std::byte* dst, Read& read);
  Status enqueue_stream(cudaStream_t stream, const std::vector<const CopySpan*>& spans,
                        const std::vector<const StridedSpan*>& strided, const std::byte* src,
                        std::byte* dst);
  // The kernel path (cuda_ipc_kernel.cpp): the plan's span table written
  // into a pinned slot, uploaded with one cudaMemcpyAsync and copied by one
  // kernel launch, on one stream, then its event; the slot stays with
  // `read` until it resolved. On a CUDA failure, waits for what was
  // enqueued and returns the error.
  Status enqueue_kernel(const std::vector<StridedSpan>& spans, const std::byte* src, std::byte* dst,
                        Read& read);
  std::unique_ptr<cuda_ipc::TableSlot> take_slot(std::size_t bytes);
  // Back to the free slots (at most kMaxFreeSlots kept), under mu_.
  void give_slot(std::unique_ptr<cuda_ipc::TableSlot> slot,
                 std::vector<std::unique_ptr<cuda_ipc::TableSlot>>& to_free) MSTAR_KV_REQUIRES(mu_);
  cudaEvent_t take_event(Status* status);
  void resolve(Read& r);
  void completion_loop();

  std::shared_ptr<KVCache> cache_;
  const cuda_ipc::DeviceMemory* memory_;
  int device_;
  EngineOptions options_;
  std::atomic<bool> batch_{true};
  bool kernel_ = false;         // cuda_ipc_copy: kernel (else memcpy)
  unsigned kernel_blocks_ = 1;  // the kernel's grid at most
  bool check_owner_pid_ = true;
  CudaIpcKVTransferInfo info_;
  KVTransferInfo encoded_;
  std::uint32_t self_pid_;
  std::vector<cudaStream_t> streams_;
  std::atomic<std::uint64_t> next_stream_{0};
  // Epoch checks copy the owner's words to the host on this stream, one at
  // a time.
  std::mutex epoch_mu_;
  cudaStream_t epoch_stream_ MSTAR_KV_GUARDED_BY(epoch_mu_) = nullptr;
  std::vector<std::uint64_t> epoch_scratch_ MSTAR_KV_GUARDED_BY(epoch_mu_);

  // Shared while a read enqueues, exclusive in shutdown: shutdown never
  // synchronises streams while a read is still enqueuing on them.
  std::shared_mutex lifecycle_mu_;
  bool shut_down_ MSTAR_KV_GUARDED_BY(lifecycle_mu_) = false;

  mutable std::mutex map_mu_;
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<RemoteMapping>> mappings_
      MSTAR_KV_GUARDED_BY(map_mu_);
  // The current generation per lineage: (owner pid, GPU, layout). A new
  // generation in a lineage replaces the old one; caches of one process that
  // differ in GPU or layout (a draft and a target model) live side by side.
  struct Current {
    std::uint32_t pid = 0;
    std::uint64_t generation = 0;
  };
  std::map<std::string, Current> current_gen_ MSTAR_KV_GUARDED_BY(map_mu_);
  std::set<std::pair<std::uint32_t, std::uint64_t>> retired_ MSTAR_KV_GUARDED_BY(map_mu_);
  std::vector<std::pair<std::uint32_t, std::uint64_t>> retired_order_ MSTAR_KV_GUARDED_BY(map_mu_);

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Read>> in_flight_ MSTAR_KV_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_events_ MSTAR_KV_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<cuda_ipc::TableSlot>> free_slots_ MSTAR_KV_GUARDED_BY(mu_);
  std::uint64_t arrivals_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  bool stop_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::thread completer_;
};

}  // namespace mstar::kv
