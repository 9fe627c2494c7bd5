// Copyright mstar-kv authors.
//
// CudaIpcKVTransferEngine: construction, reads, completion, shutdown and the
// public API over Impl (cuda_ipc_impl.hpp).
#include <cstdlib>

#include "cuda_ipc_impl.hpp"
#include "device_memory.hpp"
#include "engines/engine_makers.hpp"

namespace mstar::kv {

using namespace cuda_ipc_detail;

namespace {

bool flag(const EngineOptions& o, const std::string& key, bool fallback) {
  const auto it = o.extra.find(key);
  if (it == o.extra.end()) return fallback;
  if (it->second == "1" || it->second == "true" || it->second == "on") return true;
  if (it->second == "0" || it->second == "false" || it->second == "off") return false;
  throw Error(StatusCode::kInvalidArgument,
              "engine option " + key + "='" + it->second + "' (expected 0 or 1)");
}

// The copy path, "kernel" or "memcpy": extra["cuda_ipc_copy"], else the
// environment's MSTAR_KV_CUDA_IPC_COPY, else the build's default
// (MSTAR_KV_CUDA_IPC_COPY_DEFAULT, CMake). Throws Error(kInvalidArgument)
// naming where a bad value came from, and for "kernel" in a build without
// the kernel.
bool kernel_copies(const EngineOptions& o) {
  std::string where = "engine option cuda_ipc_copy";
  std::string value;
  if (const auto it = o.extra.find("cuda_ipc_copy"); it != o.extra.end()) {
    value = it->second;
  } else if (const char* env = std::getenv("MSTAR_KV_CUDA_IPC_COPY"); env != nullptr && *env) {
    value = env;
    where = "MSTAR_KV_CUDA_IPC_COPY";
  } else {
    value = MSTAR_KV_CUDA_IPC_COPY_DEFAULT;
    where = "the build's MSTAR_KV_CUDA_IPC_COPY_DEFAULT";
  }
  if (value != "kernel" && value != "memcpy") {
    throw Error(StatusCode::kInvalidArgument,
                where + "='" + value + "' (expected kernel or memcpy)");
  }
  if (value == "kernel" && !cuda_ipc::span_kernel_built()) {
    throw Error(StatusCode::kInvalidArgument,
                where +
                    "='kernel', but this build has no copy kernel (no CUDA compiler when it "
                    "was configured, or MSTAR_KV_CUDA_IPC_KERNEL=OFF): use memcpy");
  }
  return value == "kernel";
}

}  // namespace

CudaIpcKVTransferEngine::Impl::Impl(std::shared_ptr<KVCache> cache, const EngineOptions& options)
    : cache_(std::move(cache)),
      options_(options),
      self_pid_(static_cast<std::uint32_t>(::getpid())) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "cuda_ipc engine needs a KV cache");
  if (cache_->split()) {
    throw Error(StatusCode::kNotSupported,
                "the cuda_ipc engine serves and reads device caches of one allocation (one CUDA "
                "IPC handle); this cache has " +
                    std::to_string(cache_->num_regions()) +
                    " regions (one per layer): per-region IPC handles are not supported yet; "
                    "allocate the cache as one tensor (make_kv_cache(layout, kDevice), "
                    "KVCache.from_dlpack)");
  }
  // Options first: a typo is named before anything touches the device.
  engines::reject_unknown_keys(options_.extra, "cuda_ipc", "cuda_ipc_",
                               {"cuda_ipc_batch", "cuda_ipc_check_owner_pid", "cuda_ipc_copy"});
  kernel_ = kernel_copies(options_);
  memory_ = dynamic_cast<const cuda_ipc::DeviceMemory*>(&cache_->memory());
  if (cache_->memory_kind() != MemoryKind::kDevice || memory_ == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc engine needs a device cache (make_kv_cache(layout, "
                "MemoryKind::kDevice) or wrap_device_cache), got memory kind " +
                    std::to_string(static_cast<int>(cache_->memory_kind())));
  }
  engines::check_workers_and_timeout(options_, "cuda_ipc", kMaxStreams);
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
  if (const cuda_ipc::DeviceEpochTable* t = memory_->epoch_table(); t != nullptr) {
    info_.has_epoch_table = true;
    info_.epoch_handle = t->handle();
    info_.epoch_pages = t->num_pages();
  }
  if (const cuda_ipc::HostTables* h = memory_->host_tables(); h != nullptr) {
    info_.has_host_tables = true;
    info_.host_tables_fd = static_cast<std::uint32_t>(h->fd());
    info_.host_tables_uid = h->uid();
  }
  encoded_ = info_.encode();

  cuda_ipc::DeviceGuard guard(device_);
  for (std::uint32_t i = 0; i < options_.max_workers; ++i) {
    cudaStream_t s = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (cudaStream_t t : streams_) (void)cudaStreamDestroy(t);
      cuda_ipc::fail(StatusCode::kUnavailable, "cudaStreamCreateWithFlags", err);
    }
    streams_.push_back(s);
  }
  if (kernel_) kernel_blocks_ = cuda_ipc::span_kernel_blocks(device_);
  const cudaError_t err = cudaStreamCreateWithFlags(&epoch_stream_, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    for (cudaStream_t t : streams_) (void)cudaStreamDestroy(t);
    cuda_ipc::fail(StatusCode::kUnavailable, "cudaStreamCreateWithFlags", err);
  }
  completer_ = std::thread([this] { completion_loop(); });
}

std::optional<TransferFuture> CudaIpcKVTransferEngine::Impl::read(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> reads) {
  std::shared_lock lifecycle(lifecycle_mu_);
  if (shut_down_) throw Error(StatusCode::kShutdown, "cuda_ipc engine is shut down");
  const CudaIpcKVTransferInfo& remote = remote_as<CudaIpcKVTransferInfo>(remote_cache, "cuda_ipc");
  const std::uint64_t epoch = remote_cache.epoch();
  if (reads.empty()) return std::nullopt;  // the descriptor was validated by open_remote
  StridedPlan splan = plan_strided_copies(cache_->layout(), remote.layout, reads);
  if (splan.spans.empty()) return std::nullopt;

  auto read = std::make_unique<Read>();
  read->start = Clock::now();
  read->deadline = read->start + options_.timeout;
  read->bytes = splan.total_bytes;

  const std::byte* src = nullptr;
  if (remote.owner_pid == self_pid_) {
    if (remote.generation != info_.generation) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc descriptor of " + gen_string(remote.owner_pid, remote.generation) +
                      " was exported by this very process; CUDA IPC handles cannot be opened "
                      "by the process that exported them (only this engine's own cache, "
                      "generation " +
                      std::to_string(info_.generation) + ", is readable here)");
    }
    src = cache_->base();
  } else {
    try {
      read->mapping = acquire(remote);
    } catch (const Error& e) {
      // CUDA could not open the owner's memory: a transfer failure, through
      // the future; every other refusal is thrown before any byte moves.
      if (e.code() != StatusCode::kPeerFailure) throw;
      return make_failed_future(e.status());
    }
    src = read->mapping->base() + remote.offset_bytes();
  }

  // The memcpy path: strided spans go to cudaMemcpy2DAsync, contiguous
  // ones to cudaMemcpyAsync (or a batch); few large spans (a page-major
  // cache, contiguous pages) are split so that every stream gets a share.
  // The kernel path takes the plan as it is.
  std::vector<CopySpan> spans;
  std::vector<StridedSpan> strided;
  if (!kernel_) {
    for (const StridedSpan& s : splan.spans) {
      if (s.rows == 1)
        spans.push_back({s.local_offset, s.remote_offset, s.length});
      else
        strided.push_back(s);
    }
    if (!spans.empty() && spans.size() < streams_.size()) {
      const std::uint64_t share = std::max<std::uint64_t>(
          (splan.total_bytes + streams_.size() - 1) / streams_.size(), std::uint64_t{1} << 20);
      spans = split_spans(spans, share);
    }
  }
  // Seqlock over the owner's page epochs: every page must carry the
  // sequence's epoch before the copies and still after them (resolve).
  if (options_.check_epochs && epoch != 0) {
    if (!remote.has_epoch_table) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc descriptor names page epoch " + std::to_string(epoch) +
                      " but carries no epoch table (made from a bare cuda_share, not published "
                      "by a KVCachePool over a cuda_ipc cache): the read cannot be checked");
    }
    read->epoch = epoch;
    read->epoch_pages = remote.epoch_pages;
    read->pages = remote_pages_of(reads, remote.epoch_pages);
    if (Status s = check_epochs(*read, "before the copy", false); !s.is_ok()) {
      return make_failed_future(s);
    }
  }
  read->spans = kernel_ ? splan.spans.size() : spans.size() + strided.size();
  read->promise.mark_planned(read->spans);
  read->promise.set_peer("pid " + std::to_string(remote.owner_pid));

  cuda_ipc::DeviceGuard guard(device_);
  const Status status = kernel_ ? enqueue_kernel(splan.spans, src, cache_->base(), *read)
                                : enqueue(spans, strided, src, cache_->base(), *read);
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

void CudaIpcKVTransferEngine::Impl::resolve(Read& r) {
  const auto ms = [&](Clock::time_point t) {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(t - r.start).count());
  };
  const std::string what = "cuda_ipc read of " + std::to_string(r.bytes) + " bytes in " +
                           std::to_string(r.spans) +
                           (kernel_ ? " spans (one copy kernel launch)" : " copies");
  if (r.error != cudaSuccess) {
    r.promise.fail(Status(StatusCode::kInternal,
                          what + " failed on the GPU: " + cuda_ipc::error_text(r.error)));
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
        r->promise.fail(
            Status(StatusCode::kShutdown, "cuda_ipc engine shut down with the read in flight"));
        done.push_back(std::move(r));
      }
      in_flight_.clear();
    }
    if (!done.empty()) {
      lk.unlock();
      for (auto& r : done) resolve(*r);
      lk.lock();
      std::vector<std::unique_ptr<cuda_ipc::TableSlot>> to_free;
      for (auto& r : done) {
        free_events_.insert(free_events_.end(), r->events.begin(), r->events.end());
        r->events.clear();
        give_slot(std::move(r->table), to_free);
      }
      // Mappings are released (and maybe closed), surplus slots freed,
      // outside the lock.
      lk.unlock();
      done.clear();
      to_free.clear();
      lk.lock();
      backoff = kMinBackoff;
      continue;
    }
    cv_.wait_for(lk, backoff, [&] { return stop_ || arrivals_ != seen_arrivals; });
    if (arrivals_ != seen_arrivals) {
      seen_arrivals = arrivals_;
      backoff = kMinBackoff;
    } else {
      backoff =
          std::min(backoff * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxBackoff));
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
    cuda_ipc::DeviceGuard guard(device_);
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
    cuda_ipc::DeviceGuard guard(device_);
    std::lock_guard lk(mu_);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    free_events_.clear();
    free_slots_.clear();
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
                                                 const TransferEngineInfo& info)
    : CudaIpcKVTransferEngine(std::move(kv_cache), info.options) {}

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

RemoteHandle CudaIpcKVTransferEngine::open_remote(const KVTransferInfo& remote) const {
  CudaIpcKVTransferInfo info = CudaIpcKVTransferInfo::decode(remote);
  impl_->layout().check_same_model(info.layout);
  KVLayout layout = info.layout;
  return std::make_shared<TypedRemote<CudaIpcKVTransferInfo>>(remote, std::move(info),
                                                              std::move(layout));
}

std::optional<TransferFuture> CudaIpcKVTransferEngine::read_batched_async(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  return impl_->read(remote, read_info);
}

void CudaIpcKVTransferEngine::shutdown() { impl_->shutdown(); }

std::unique_ptr<LayerWatch> CudaIpcKVTransferEngine::watch_layers(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  return impl_->watch_layers(remote, read_info);
}

std::size_t CudaIpcKVTransferEngine::open_handles() const { return impl_->open_handles(); }

std::string CudaIpcKVTransferEngine::copy_path() const {
  return impl_->kernel() ? "kernel" : "memcpy";
}

namespace engines {

EngineHooks hooks_cuda_ipc() {
  EngineHooks h;
  h.make = &make<CudaIpcKVTransferEngine>;
  h.allocate = [](const KVLayout& layout, int device) -> std::unique_ptr<KVMemory> {
    return cuda_ipc::DeviceMemory::allocate(layout.total_bytes(), device);
  };
  return h;
}

}  // namespace engines

}  // namespace mstar::kv
