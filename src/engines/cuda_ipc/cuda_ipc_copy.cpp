// Copyright mstar-kv authors.
//
// CudaIpcKVTransferEngine::Impl: copies enqueued on the streams, page epoch checks.
#include "cuda_ipc_impl.hpp"

namespace mstar::kv {

using namespace cuda_ipc_detail;

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
    *status =
        Status(StatusCode::kInternal, "cudaEventCreateWithFlags: " + cuda_ipc::error_text(err));
    return nullptr;
  }
  return e;
}

Status CudaIpcKVTransferEngine::Impl::enqueue_stream(cudaStream_t stream,
                                                     const std::vector<const CopySpan*>& spans,
                                                     const std::vector<const StridedSpan*>& strided,
                                                     const std::byte* src, std::byte* dst) {
  // Strided spans (a change of in-page order or head shard): one 2D copy
  // each, rows of `length` bytes at the two sides' pitches.
  for (const StridedSpan* s : strided) {
    const cudaError_t err = cudaMemcpy2DAsync(
        dst + s->local_offset, static_cast<std::size_t>(s->local_stride), src + s->remote_offset,
        static_cast<std::size_t>(s->remote_stride), static_cast<std::size_t>(s->length),
        static_cast<std::size_t>(s->rows), cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) {
      return Status(StatusCode::kInternal, "cudaMemcpy2DAsync of " + std::to_string(s->rows) +
                                               " rows of " + std::to_string(s->length) +
                                               " bytes: " + cuda_ipc::error_text(err));
    }
  }
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
      const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr,
                                                   &attr_index, 1, stream);
      if (err != cudaSuccess) {
        // The runtime or driver cannot batch these: fall back to one call
        // per span from now on. Re-issuing copies the batch may have queued
        // writes the same bytes to the same places, so it is harmless.
        (void)cuda_ipc::error_text(err);
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
      return Status(StatusCode::kInternal, "cudaMemcpyAsync of " + std::to_string(s->length) +
                                               " bytes: " + cuda_ipc::error_text(err));
    }
  }
  return Status::ok();
}

Status CudaIpcKVTransferEngine::Impl::enqueue(const std::vector<CopySpan>& spans,
                                              const std::vector<StridedSpan>& strided,
                                              const std::byte* src, std::byte* dst, Read& read) {
  const std::size_t n = std::min(streams_.size(), std::max(spans.size(), strided.size()));
  const std::size_t first = static_cast<std::size_t>(
      next_stream_.fetch_add(1, std::memory_order_relaxed) % streams_.size());
  std::vector<std::vector<const CopySpan*>> buckets(n);
  std::vector<std::vector<const StridedSpan*>> strided_buckets(n);
  for (std::size_t i = 0; i < spans.size(); ++i) buckets[i % n].push_back(&spans[i]);
  for (std::size_t i = 0; i < strided.size(); ++i) strided_buckets[i % n].push_back(&strided[i]);

  Status status;
  std::size_t touched = 0;
  for (std::size_t b = 0; b < n && status.is_ok(); ++b) {
    cudaStream_t stream = streams_[(first + b) % streams_.size()];
    ++touched;
    status = enqueue_stream(stream, buckets[b], strided_buckets[b], src, dst);
    if (!status.is_ok()) break;
    cudaEvent_t ev = take_event(&status);
    if (ev == nullptr) break;
    read.events.push_back(ev);
    const cudaError_t err = cudaEventRecord(ev, stream);
    if (err != cudaSuccess) {
      status = Status(StatusCode::kInternal, "cudaEventRecord: " + cuda_ipc::error_text(err));
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

Status CudaIpcKVTransferEngine::Impl::check_epochs(const Read& r, std::string_view when,
                                                   bool after_copy) {
  if (r.mapping == nullptr) {  // our own cache: its host table is the truth
    const PageEpochs& ep = cache_->epochs();
    return check_page_epochs(ep.words(), ep.num_pages(), r.pages, r.epoch, when, after_copy);
  }
  std::lock_guard lk(epoch_mu_);
  try {
    cuda_ipc::DeviceGuard guard(device_);
    return cuda_ipc::check_device_epochs(r.mapping->epochs(), r.epoch_pages, r.pages, r.epoch, when,
                                         after_copy, epoch_stream_, epoch_scratch_);
  } catch (const Error& e) {
    return e.status();
  }
}

}  // namespace mstar::kv
