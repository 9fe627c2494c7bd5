// Copyright mstar-kv authors.
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
#include "mstar/kv/cuda_ipc.hpp"
#include "mstar/kv/planner.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMaxStreams = 64;
constexpr auto kMinBackoff = std::chrono::microseconds(20);
constexpr auto kMaxBackoff = std::chrono::microseconds(1000);
// Copies per cudaMemcpyBatchAsync call: bounds the host arrays built per call.
constexpr std::size_t kBatchChunk = 4096;
// Generations remembered as replaced, per engine (oldest forgotten first).
constexpr std::size_t kMaxRetired = 4096;

std::string gen_string(std::uint32_t pid, std::uint64_t gen) {
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
      cuda::DeviceGuard guard(device_);
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

bool flag(const EngineOptions& o, const std::string& key, bool fallback) {
  const auto it = o.extra.find(key);
  if (it == o.extra.end()) return fallback;
  if (it->second == "1" || it->second == "true" || it->second == "on") return true;
  if (it->second == "0" || it->second == "false" || it->second == "off") return false;
  throw Error(StatusCode::kInvalidArgument,
              "engine option " + key + "='" + it->second + "' (expected 0 or 1)");
}

}  // namespace

class CudaIpcKVTransferEngine::Impl {
 public:
  Impl(std::shared_ptr<KVCache> cache, const EngineOptions& options);
  ~Impl() { shutdown(); }

  const CudaIpcKVTransferInfo& info() const noexcept { return info_; }
  const KVTransferInfo& encoded() const noexcept { return encoded_; }
  std::optional<TransferFuture> read(const KVTransferInfo& remote_kv_info,
                                     std::span<const KVReadInfo> reads);
  void shutdown();
  std::size_t open_handles() const {
    std::lock_guard lk(map_mu_);
    return mappings_.size();
  }

 private:
  struct Read {
    TransferPromise promise;
    std::vector<cudaEvent_t> events;          // one per stream used
    std::shared_ptr<RemoteMapping> mapping;   // null when reading our own cache
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

  // The mapping for `remote`, opened now if needed. Throws Error for
  // stale / dead / unreachable owners; a CUDA failure to open comes back as
  // a non-ok Status (delivered through the future).
  std::shared_ptr<RemoteMapping> acquire(const CudaIpcKVTransferInfo& remote, Status* status);
  // Enqueues every span and records the events into `read`. On a CUDA
  // failure, waits for what was enqueued and returns the error.
  Status enqueue(const std::vector<CopySpan>& spans, const std::byte* src, std::byte* dst,
                 Read& read);
  Status enqueue_stream(cudaStream_t stream, const std::vector<const CopySpan*>& spans,
                        const std::byte* src, std::byte* dst);
  cudaEvent_t take_event(Status* status);
  void resolve(Read& r);
  void completion_loop();

  std::shared_ptr<KVCache> cache_;
  const cuda::DeviceMemory* memory_;
  int device_;
  EngineOptions options_;
  std::atomic<bool> batch_{true};
  bool check_owner_pid_ = true;
  CudaIpcKVTransferInfo info_;
  KVTransferInfo encoded_;
  std::uint32_t self_pid_;
  std::vector<cudaStream_t> streams_;
  std::atomic<std::uint64_t> next_stream_{0};
  // Epoch checks copy the owner's words to the host on this stream, one at
  // a time.
  std::mutex epoch_mu_;
  cudaStream_t epoch_stream_ = nullptr;              // guarded by epoch_mu_
  std::vector<std::uint64_t> epoch_scratch_;         // guarded by epoch_mu_

  // Shared while a read enqueues, exclusive in shutdown: shutdown never
  // synchronises streams while a read is still enqueuing on them.
  std::shared_mutex lifecycle_mu_;
  bool shut_down_ = false;  // guarded by lifecycle_mu_

  mutable std::mutex map_mu_;
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<RemoteMapping>>
      mappings_;                                           // guarded by map_mu_
  // The current generation per lineage: (owner pid, GPU, layout). A new
  // generation in a lineage replaces the old one; caches of one process that
  // differ in GPU or layout (a draft and a target model) live side by side.
  struct Current {
    std::uint32_t pid = 0;
    std::uint64_t generation = 0;
  };
  std::map<std::string, Current> current_gen_;             // guarded by map_mu_
  std::set<std::pair<std::uint32_t, std::uint64_t>> retired_;  // guarded by map_mu_
  std::vector<std::pair<std::uint32_t, std::uint64_t>> retired_order_;  // guarded by map_mu_

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Read>> in_flight_;  // guarded by mu_
  std::vector<cudaEvent_t> free_events_;          // guarded by mu_
  std::uint64_t arrivals_ = 0;                    // guarded by mu_
  bool stop_ = false;                             // guarded by mu_
  std::thread completer_;
};

CudaIpcKVTransferEngine::Impl::Impl(std::shared_ptr<KVCache> cache,
                                    const EngineOptions& options)
    : cache_(std::move(cache)), options_(options), self_pid_(static_cast<std::uint32_t>(::getpid())) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "cuda_ipc engine needs a KV cache");
  // Options first: a typo is named before anything touches the device.
  engines::reject_unknown_keys(options_.extra, "cuda_ipc", "cuda_ipc_",
                               {"cuda_ipc_batch", "cuda_ipc_check_owner_pid"});
  memory_ = dynamic_cast<const cuda::DeviceMemory*>(&cache_->memory());
  if (cache_->memory_kind() != MemoryKind::kDevice || memory_ == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc engine needs a device cache (make_kv_cache(layout, "
                "MemoryKind::kDevice) or wrap_device_cache), got memory kind " +
                    std::to_string(static_cast<int>(cache_->memory_kind())));
  }
  if (options_.max_workers < 1 || options_.max_workers > kMaxStreams) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc max_workers " + std::to_string(options_.max_workers) +
                    " out of range [1, " + std::to_string(kMaxStreams) + "]");
  }
  if (options_.timeout.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc timeout " + std::to_string(options_.timeout.count()) +
                    " ms out of range [1, ...)");
  }
  batch_.store(flag(options_, "cuda_ipc_batch", true), std::memory_order_relaxed);
  check_owner_pid_ = flag(options_, "cuda_ipc_check_owner_pid", true);
  device_ = memory_->device();

  const KVLayout& layout = cache_->layout();
  info_.cuda_share = memory_->share();
  info_.size = CudaIpcKVTransferInfo::view_size(layout);
  info_.stride = CudaIpcKVTransferInfo::view_stride(layout);
  if (memory_->offset_bytes() % layout.element_size() != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "device cache starts " + std::to_string(memory_->offset_bytes()) +
                    " bytes into its allocation, not a multiple of the " +
                    std::to_string(layout.element_size()) + "-byte element");
  }
  info_.offset = static_cast<std::int64_t>(memory_->offset_bytes() / layout.element_size());
  info_.dtype = std::string(to_string(layout.dtype));
  info_.requires_grad = false;
  info_.layout = layout;
  info_.generation = memory_->generation();
  info_.owner_pid = self_pid_;
  if (const cuda::DeviceEpochTable* t = memory_->epoch_table(); t != nullptr) {
    info_.has_epoch_table = true;
    info_.epoch_handle = t->handle();
    info_.epoch_pages = t->num_pages();
  }
  encoded_ = info_.encode();

  cuda::DeviceGuard guard(device_);
  for (std::uint32_t i = 0; i < options_.max_workers; ++i) {
    cudaStream_t s = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (cudaStream_t t : streams_) (void)cudaStreamDestroy(t);
      cuda::fail(StatusCode::kUnavailable, "cudaStreamCreateWithFlags", err);
    }
    streams_.push_back(s);
  }
  const cudaError_t err = cudaStreamCreateWithFlags(&epoch_stream_, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    for (cudaStream_t t : streams_) (void)cudaStreamDestroy(t);
    cuda::fail(StatusCode::kUnavailable, "cudaStreamCreateWithFlags", err);
  }
  completer_ = std::thread([this] { completion_loop(); });
}

std::shared_ptr<RemoteMapping> CudaIpcKVTransferEngine::Impl::acquire(
    const CudaIpcKVTransferInfo& remote, Status* status) {
  const std::uint32_t pid = remote.owner_pid;
  const auto key = std::make_pair(pid, remote.generation);
  std::lock_guard lk(map_mu_);
  const std::string lineage = std::to_string(pid) + " " +
                              cuda::uuid_string(remote.cuda_share.device_uuid.data()) + " " +
                              remote.layout.to_string();
  if (retired_.count(key) != 0) {
    const auto cur = current_gen_.find(lineage);
    throw Error(StatusCode::kStaleDescriptor,
                "cuda_ipc descriptor of " + gen_string(pid, remote.generation) +
                    " was replaced by a newer cache of that process on the same GPU with the "
                    "same layout" +
                    (cur != current_gen_.end()
                         ? " (generation " + std::to_string(cur->second.generation) + ")"
                         : std::string()));
  }
  // A dead owner: its memory may still be mapped here, but its pages mean
  // nothing any more. (A recycled pid passes this check; its generation
  // then differs.)
  if (check_owner_pid_ && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      it = it->first.first == pid ? mappings_.erase(it) : std::next(it);
    }
    for (auto it = current_gen_.begin(); it != current_gen_.end();) {
      it = it->second.pid == pid ? current_gen_.erase(it) : std::next(it);
    }
    throw Error(StatusCode::kNotFound, "cuda_ipc owner process " + std::to_string(pid) +
                                           " of generation " + std::to_string(remote.generation) +
                                           " is gone");
  }
  if (auto it = mappings_.find(key); it != mappings_.end()) return it->second;

  // The owner's GPU must be visible here and reachable from ours.
  const int owner_dev = cuda::device_with_uuid(remote.cuda_share.device_uuid.data());
  if (owner_dev < 0) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc descriptor names GPU " +
                    cuda::uuid_string(remote.cuda_share.device_uuid.data()) +
                    " (device " + std::to_string(remote.cuda_share.device) +
                    " of pid " + std::to_string(pid) +
                    "), which is not visible in this process (check CUDA_VISIBLE_DEVICES)");
  }
  if (owner_dev != device_) {
    int can = 0;
    const cudaError_t err = cudaDeviceCanAccessPeer(&can, device_, owner_dev);
    if (err != cudaSuccess) {
      *status = Status(StatusCode::kPeerFailure,
                       "cudaDeviceCanAccessPeer: " + cuda::error_text(err));
      return nullptr;
    }
    if (can == 0) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc: device " + std::to_string(device_) +
                      " cannot access peer device " + std::to_string(owner_dev) +
                      " holding the owner's cache (no P2P between them)");
    }
  }

  cudaIpcMemHandle_t handle{};
  std::memcpy(handle.reserved, remote.cuda_share.handle.data(), CudaIpcShare::kHandleBytes);
  void* base = nullptr;
  {
    cuda::DeviceGuard guard(device_);
    const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      *status = Status(StatusCode::kPeerFailure,
                       "cudaIpcOpenMemHandle for " + gen_string(pid, remote.generation) +
                           " failed: " + cuda::error_text(err));
      return nullptr;
    }
  }
  auto mapping = std::make_shared<RemoteMapping>(base, device_);
  if (remote.has_epoch_table) {
    cudaIpcMemHandle_t eh{};
    std::memcpy(eh.reserved, remote.epoch_handle.data(), CudaIpcShare::kHandleBytes);
    void* ep = nullptr;
    cuda::DeviceGuard guard(device_);
    const cudaError_t err = cudaIpcOpenMemHandle(&ep, eh, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      *status = Status(StatusCode::kPeerFailure,
                       "cudaIpcOpenMemHandle of the page epoch table of " +
                           gen_string(pid, remote.generation) + " failed: " +
                           cuda::error_text(err));
      return nullptr;
    }
    mapping->set_epochs(ep);
    // Untrusted length: the table must hold epoch_pages words.
    cuda::AddressRange er;
    bool eknown = false;
    try {
      eknown = cuda::allocation_range(ep, &er);
    } catch (const Error&) {
      eknown = false;
    }
    const auto e = reinterpret_cast<std::uintptr_t>(ep);
    if (eknown && (e < er.base || std::uint64_t{remote.epoch_pages} * 8 > er.size - (e - er.base))) {
      throw Error(StatusCode::kCorruptDescriptor,
                  "cuda_ipc descriptor of " + gen_string(pid, remote.generation) + " names " +
                      std::to_string(remote.epoch_pages) +
                      " page epochs; their handle maps " + std::to_string(er.size) + " bytes");
    }
  }
  // The descriptor's sizes are untrusted: check the view against what the
  // handle really maps, so that no copy can run past the mapping.
  cuda::AddressRange range;
  bool known = false;
  try {
    known = cuda::allocation_range(base, &range);
  } catch (const Error&) {
    known = false;  // the driver cannot say; the descriptor checks stand alone
  }
  const std::uint64_t view_end = remote.offset_bytes() + remote.layout.total_bytes();
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  if (known && (b < range.base || b - range.base > range.size ||
                view_end > range.size - (b - range.base))) {
    throw Error(StatusCode::kCorruptDescriptor,
                "cuda_ipc descriptor of " + gen_string(pid, remote.generation) +
                    " puts the cache at bytes [" + std::to_string(remote.offset_bytes()) + ", " +
                    std::to_string(view_end) + ") of an allocation it says holds " +
                    std::to_string(remote.cuda_share.allocation_bytes) +
                    " bytes; the handle maps " + std::to_string(range.size) + " bytes");
  }
  // A new generation replaces its lineage's previous one: forget that (its
  // handle closes once reads in flight on it drain) and refuse it from now on.
  if (auto cur = current_gen_.find(lineage);
      cur != current_gen_.end() && cur->second.generation != key.second) {
    const auto old = std::make_pair(pid, cur->second.generation);
    mappings_.erase(old);
    retired_.insert(old);
    retired_order_.push_back(old);
    if (retired_order_.size() > kMaxRetired) {
      retired_.erase(retired_order_.front());
      retired_order_.erase(retired_order_.begin());
    }
  }
  current_gen_[lineage] = Current{pid, key.second};
  mappings_[key] = mapping;
  return mapping;
}

cudaEvent_t CudaIpcKVTransferEngine::Impl::take_event(Status* status) {
  {
    std::lock_guard lk(mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    *status = Status(StatusCode::kInternal, "cudaEventCreateWithFlags: " + cuda::error_text(err));
    return nullptr;
  }
  return e;
}

Status CudaIpcKVTransferEngine::Impl::enqueue_stream(cudaStream_t stream,
                                                     const std::vector<const CopySpan*>& spans,
                                                     const std::byte* src, std::byte* dst) {
#if CUDART_VERSION >= 13000
  if (batch_.load(std::memory_order_relaxed)) {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes;
    bool ok = true;
    for (std::size_t first = 0; first < spans.size() && ok; first += kBatchChunk) {
      const std::size_t n = std::min(kBatchChunk, spans.size() - first);
      dsts.resize(n);
      srcs.resize(n);
      sizes.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const CopySpan& s = *spans[first + i];
        dsts[i] = dst + s.local_offset;
        srcs[i] = src + s.remote_offset;
        sizes[i] = static_cast<std::size_t>(s.length);
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagDefault;
      std::size_t attr_index = 0;
      const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n,
                                                   &attr, &attr_index, 1, stream);
      if (err != cudaSuccess) {
        // The runtime or driver cannot batch these: fall back to one call
        // per span from now on. Re-issuing copies the batch may have queued
        // writes the same bytes to the same places, so it is harmless.
        (void)cuda::error_text(err);
        batch_.store(false, std::memory_order_relaxed);
        ok = false;
      }
    }
    if (ok) return Status::ok();
  }
#endif
  for (const CopySpan* s : spans) {
    const cudaError_t err =
        cudaMemcpyAsync(dst + s->local_offset, src + s->remote_offset,
                        static_cast<std::size_t>(s->length), cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) {
      return Status(StatusCode::kInternal,
                    "cudaMemcpyAsync of " + std::to_string(s->length) + " bytes: " +
                        cuda::error_text(err));
    }
  }
  return Status::ok();
}

Status CudaIpcKVTransferEngine::Impl::enqueue(const std::vector<CopySpan>& spans,
                                              const std::byte* src, std::byte* dst, Read& read) {
  const std::size_t n = std::min(streams_.size(), spans.size());
  const std::size_t first = static_cast<std::size_t>(
      next_stream_.fetch_add(1, std::memory_order_relaxed) % streams_.size());
  std::vector<std::vector<const CopySpan*>> buckets(n);
  for (std::size_t i = 0; i < spans.size(); ++i) buckets[i % n].push_back(&spans[i]);

  Status status;
  std::size_t touched = 0;
  for (std::size_t b = 0; b < n && status.is_ok(); ++b) {
    cudaStream_t stream = streams_[(first + b) % streams_.size()];
    ++touched;
    status = enqueue_stream(stream, buckets[b], src, dst);
    if (!status.is_ok()) break;
    cudaEvent_t ev = take_event(&status);
    if (ev == nullptr) break;
    read.events.push_back(ev);
    const cudaError_t err = cudaEventRecord(ev, stream);
    if (err != cudaSuccess) {
      status = Status(StatusCode::kInternal, "cudaEventRecord: " + cuda::error_text(err));
    }
  }
  if (!status.is_ok()) {
    // Copies already queued cannot be withdrawn: let them finish before the
    // failure is reported, so that no byte lands after the future resolves.
    for (std::size_t b = 0; b < touched; ++b) {
      if (cudaStreamSynchronize(streams_[(first + b) % streams_.size()]) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    std::lock_guard lk(mu_);
    free_events_.insert(free_events_.end(), read.events.begin(), read.events.end());
    read.events.clear();
  }
  return status;
}

std::optional<TransferFuture> CudaIpcKVTransferEngine::Impl::read(
    const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> reads) {
  std::shared_lock lifecycle(lifecycle_mu_);
  if (shut_down_) throw Error(StatusCode::kShutdown, "cuda_ipc engine is shut down");
  const CudaIpcKVTransferInfo remote = CudaIpcKVTransferInfo::decode(remote_kv_info);
  cache_->layout().check_same_model(remote.layout);
  if (reads.empty()) return std::nullopt;
  CopyPlan plan = plan_copies(cache_->layout(), remote.layout, reads);
  if (plan.spans.empty()) return std::nullopt;

  auto read = std::make_unique<Read>();
  read->start = Clock::now();
  read->deadline = read->start + options_.timeout;
  read->bytes = plan.total_bytes;

  const std::byte* src = nullptr;
  if (remote.owner_pid == self_pid_) {
    if (remote.generation != info_.generation) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc descriptor of " + gen_string(remote.owner_pid, remote.generation) +
                      " was exported by this very process; CUDA IPC handles cannot be opened "
                      "by the process that exported them (only this engine's own cache, "
                      "generation " + std::to_string(info_.generation) + ", is readable here)");
    }
    src = cache_->base();
  } else {
    Status status;
    read->mapping = acquire(remote, &status);
    if (!status.is_ok()) return make_failed_future(status);
    src = read->mapping->base() + remote.offset_bytes();
  }

  // Few large spans (a page-major cache, contiguous pages) are split so
  // that every stream gets a share.
  std::vector<CopySpan> spans = std::move(plan.spans);
  if (spans.size() < streams_.size()) {
    const std::uint64_t share =
        std::max<std::uint64_t>((plan.total_bytes + streams_.size() - 1) / streams_.size(),
                                std::uint64_t{1} << 20);
    spans = split_spans(spans, share);
  }
  // Seqlock over the owner's page epochs: every page must carry the
  // sequence's epoch before the copies and still after them (resolve).
  if (options_.check_epochs && remote_kv_info.epoch != 0) {
    if (!remote.has_epoch_table) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc descriptor names page epoch " + std::to_string(remote_kv_info.epoch) +
                      " but carries no epoch table (made from a bare cuda_share, not published "
                      "by a KVCachePool over a cuda_ipc cache): the read cannot be checked");
    }
    read->epoch = remote_kv_info.epoch;
    read->epoch_pages = remote.epoch_pages;
    read->pages = remote_pages_of(reads, remote.epoch_pages);
    if (Status s = check_epochs(*read, "before the copy", false); !s.is_ok()) {
      return make_failed_future(s);
    }
  }
  read->spans = spans.size();
  read->promise.mark_planned(spans.size());
  read->promise.set_peer("pid " + std::to_string(remote.owner_pid));

  cuda::DeviceGuard guard(device_);
  const Status status = enqueue(spans, src, cache_->base(), *read);
  if (!status.is_ok()) return make_failed_future(status);
  read->promise.mark_posted();  // every copy is enqueued
  TransferFuture future = read->promise.future();
  {
    std::lock_guard lk(mu_);
    in_flight_.push_back(std::move(read));
    ++arrivals_;
  }
  cv_.notify_one();
  return future;
}

Status CudaIpcKVTransferEngine::Impl::check_epochs(const Read& r, std::string_view when,
                                                   bool after_copy) {
  if (r.mapping == nullptr) {  // our own cache: its host table is the truth
    const PageEpochs& ep = cache_->epochs();
    return check_page_epochs(ep.words(), ep.num_pages(), r.pages, r.epoch, when, after_copy);
  }
  std::lock_guard lk(epoch_mu_);
  try {
    cuda::DeviceGuard guard(device_);
    return cuda::check_device_epochs(r.mapping->epochs(), r.epoch_pages, r.pages, r.epoch, when,
                                     after_copy, epoch_stream_, epoch_scratch_);
  } catch (const Error& e) {
    return e.status();
  }
}

void CudaIpcKVTransferEngine::Impl::resolve(Read& r) {
  const auto ms = [&](Clock::time_point t) {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(t - r.start).count());
  };
  const std::string what = "cuda_ipc read of " + std::to_string(r.bytes) + " bytes in " +
                           std::to_string(r.spans) + " copies";
  if (r.error != cudaSuccess) {
    r.promise.fail(Status(StatusCode::kInternal,
                          what + " failed on the GPU: " + cuda::error_text(r.error)));
  } else if (r.timed_out) {
    r.promise.fail(Status(StatusCode::kTimeout,
                          what + " did not finish in " + std::to_string(options_.timeout.count()) +
                              " ms (resolved once its queued copies drained, after " +
                              ms(Clock::now()) + " ms)"));
  } else if (r.cancelled) {
    r.promise.fail(Status(StatusCode::kCancelled,
                          what + " cancelled (resolved once its queued copies drained)"));
  } else if (Status s = r.epoch != 0 ? check_epochs(r, "after the copy", true) : Status::ok();
             !s.is_ok()) {
    r.promise.fail(s);
  } else {
    r.promise.complete(r.bytes);
  }
}

void CudaIpcKVTransferEngine::Impl::completion_loop() {
  // Event queries need no current device, but a thread without one would
  // make the runtime pick device 0; be explicit.
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  auto backoff = std::chrono::duration_cast<std::chrono::microseconds>(kMinBackoff);
  std::unique_lock lk(mu_);
  std::uint64_t seen_arrivals = arrivals_;
  for (;;) {
    if (in_flight_.empty()) {
      if (stop_) return;
      cv_.wait(lk, [&] { return stop_ || !in_flight_.empty(); });
      backoff = kMinBackoff;
      continue;
    }
    const Clock::time_point now = Clock::now();
    std::vector<std::unique_ptr<Read>> done;
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      Read& r = **it;
      bool pending = false;
      for (cudaEvent_t ev : r.events) {
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaErrorNotReady) {
          pending = true;
        } else if (e != cudaSuccess && r.error == cudaSuccess) {
          r.error = e;
        }
      }
      if (pending && r.error == cudaSuccess) {
        if (now >= r.deadline) r.timed_out = true;
        if (r.promise.cancel_requested()) r.cancelled = true;
        ++it;
        continue;
      }
      done.push_back(std::move(*it));
      it = in_flight_.erase(it);
    }
    if (stop_) {
      // shutdown() synchronised every stream first: whatever is still
      // listed is finished or failed; resolve the rest as shut down.
      for (auto& r : in_flight_) {
        r->promise.fail(Status(StatusCode::kShutdown,
                               "cuda_ipc engine shut down with the read in flight"));
        done.push_back(std::move(r));
      }
      in_flight_.clear();
    }
    if (!done.empty()) {
      lk.unlock();
      for (auto& r : done) resolve(*r);
      lk.lock();
      for (auto& r : done) {
        free_events_.insert(free_events_.end(), r->events.begin(), r->events.end());
        r->events.clear();
      }
      // Mappings are released (and maybe closed) outside the lock.
      lk.unlock();
      done.clear();
      lk.lock();
      backoff = kMinBackoff;
      continue;
    }
    cv_.wait_for(lk, backoff, [&] { return stop_ || arrivals_ != seen_arrivals; });
    if (arrivals_ != seen_arrivals) {
      seen_arrivals = arrivals_;
      backoff = kMinBackoff;
    } else {
      backoff = std::min(backoff * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxBackoff));
    }
  }
}

void CudaIpcKVTransferEngine::Impl::shutdown() {
  {
    std::unique_lock lifecycle(lifecycle_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  // No read enqueues any more. Let every queued copy finish: they cannot be
  // withdrawn, and nothing may land after the futures resolve or after the
  // handles close.
  try {
    cuda::DeviceGuard guard(device_);
    for (cudaStream_t s : streams_) {
      if (cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
    }
  } catch (const Error&) {
  }
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (completer_.joinable()) completer_.join();
  {
    std::lock_guard lk(map_mu_);
    mappings_.clear();  // closes every handle: no read holds one any more
    current_gen_.clear();
  }
  try {
    cuda::DeviceGuard guard(device_);
    std::lock_guard lk(mu_);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    free_events_.clear();
    for (cudaStream_t s : streams_) (void)cudaStreamDestroy(s);
    streams_.clear();
    std::lock_guard elk(epoch_mu_);
    if (epoch_stream_ != nullptr) (void)cudaStreamDestroy(epoch_stream_);
    epoch_stream_ = nullptr;
  } catch (const Error&) {
  }
}

CudaIpcKVTransferEngine::CudaIpcKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                                 const EngineOptions& options)
    : impl_(std::make_unique<Impl>(std::move(kv_cache), options)) {}

CudaIpcKVTransferEngine::CudaIpcKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                                 std::uint32_t max_workers)
    : CudaIpcKVTransferEngine(std::move(kv_cache), [&] {
        EngineOptions o;
        o.max_workers = max_workers;
        return o;
      }()) {}

CudaIpcKVTransferEngine::~CudaIpcKVTransferEngine() = default;

KVTransferInfo CudaIpcKVTransferEngine::get_kv_transfer_info() const { return impl_->encoded(); }

const CudaIpcKVTransferInfo& CudaIpcKVTransferEngine::info() const noexcept {
  return impl_->info();
}

std::optional<KVLayout> CudaIpcKVTransferEngine::remote_layout(
    const KVTransferInfo& remote) const {
  return CudaIpcKVTransferInfo::decode(remote).layout;
}

std::optional<TransferFuture> CudaIpcKVTransferEngine::read_batched_async(
    const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> read_info) {
  return impl_->read(remote_kv_info, read_info);
}

void CudaIpcKVTransferEngine::shutdown() { impl_->shutdown(); }

std::size_t CudaIpcKVTransferEngine::open_handles() const { return impl_->open_handles(); }

namespace engines {

std::unique_ptr<KVTransferEngine> make_cuda_ipc_engine(std::shared_ptr<KVCache> cache,
                                                       const TransferEngineInfo& info) {
  return std::make_unique<CudaIpcKVTransferEngine>(std::move(cache), info.options);
}

}  // namespace engines

}  // namespace mstar::kv
