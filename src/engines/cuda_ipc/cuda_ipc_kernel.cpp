// Copyright mstar-kv authors.
//
// CudaIpcKVTransferEngine::Impl, the kernel path (cuda_ipc_copy=kernel): a
// read is its span table written once into pinned memory, one upload, one
// launch of the copy kernel and one event, on one of the engine's streams,
// whatever the number of spans (span_kernel.hpp).
#include "core/span_table.hpp"
#include "cuda_ipc_impl.hpp"

namespace mstar::kv {

using namespace cuda_ipc_detail;

std::unique_ptr<cuda_ipc::TableSlot> CudaIpcKVTransferEngine::Impl::take_slot(std::size_t bytes) {
  {
    std::lock_guard lk(mu_);
    // The smallest free slot that holds the table.
    std::size_t best = free_slots_.size();
    for (std::size_t i = 0; i < free_slots_.size(); ++i) {
      if (free_slots_[i]->capacity() >= bytes &&
          (best == free_slots_.size() ||
           free_slots_[i]->capacity() < free_slots_[best]->capacity())) {
        best = i;
      }
    }
    if (best != free_slots_.size()) {
      auto slot = std::move(free_slots_[best]);
      free_slots_.erase(free_slots_.begin() + static_cast<std::ptrdiff_t>(best));
      return slot;
    }
  }
  return std::make_unique<cuda_ipc::TableSlot>(bytes);  // throws Error(kInternal)
}

void CudaIpcKVTransferEngine::Impl::give_slot(
    std::unique_ptr<cuda_ipc::TableSlot> slot,
    std::vector<std::unique_ptr<cuda_ipc::TableSlot>>& to_free) {
  if (!slot) return;
  free_slots_.push_back(std::move(slot));
  if (free_slots_.size() > kMaxFreeSlots) {
    // Drop the smallest: the next large read keeps its block.
    auto smallest = std::min_element(
        free_slots_.begin(), free_slots_.end(),
        [](const auto& a, const auto& b) { return a->capacity() < b->capacity(); });
    to_free.push_back(std::move(*smallest));
    free_slots_.erase(smallest);
  }
}

Status CudaIpcKVTransferEngine::Impl::enqueue_kernel(const std::vector<StridedSpan>& spans,
                                                     const std::byte* src, std::byte* dst,
                                                     Read& read) {
  const walk::TableSize size = walk::measure_table(spans);
  const std::size_t bytes = walk::table_bytes(size);
  try {
    read.table = take_slot(bytes);
  } catch (const Error& e) {
    return e.status();
  }
  const walk::WalkTable table = walk::write_table(spans, walk::Packing::kNone, 0, size,
                                                  read.table->host(), read.table->device());
  cudaStream_t stream =
      streams_[next_stream_.fetch_add(1, std::memory_order_relaxed) % streams_.size()];
  Status status;
  bool enqueued = false;
  cudaError_t err = cudaMemcpyAsync(read.table->device(), read.table->host(), bytes,
                                    cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) {
    status = Status(StatusCode::kInternal, "cudaMemcpyAsync of a " + std::to_string(bytes) +
                                               "-byte span table: " + cuda_ipc::error_text(err));
  } else {
    enqueued = true;
    err = cuda_ipc::launch_span_copy(table, src, dst, kernel_blocks_, stream);
    if (err != cudaSuccess) {
      status = Status(StatusCode::kInternal,
                      "copy kernel launch over " + std::to_string(size.entries) + " spans (" +
                          std::to_string(size.bytes) + " bytes): " + cuda_ipc::error_text(err));
    }
  }
  if (status.is_ok()) {
    cudaEvent_t ev = take_event(&status);
    if (ev != nullptr) {
      read.events.push_back(ev);
      err = cudaEventRecord(ev, stream);
      if (err != cudaSuccess) {
        status = Status(StatusCode::kInternal, "cudaEventRecord: " + cuda_ipc::error_text(err));
      }
    }
  }
  if (!status.is_ok()) {
    // What was enqueued cannot be withdrawn: it finishes before the failure
    // is reported (no byte lands after the future resolves, and the slot is
    // not reused while the upload may still read it).
    if (enqueued && cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
    std::vector<std::unique_ptr<cuda_ipc::TableSlot>> to_free;
    {
      std::lock_guard lk(mu_);
      free_events_.insert(free_events_.end(), read.events.begin(), read.events.end());
      read.events.clear();
      give_slot(std::move(read.table), to_free);
    }
  }
  return status;
}

}  // namespace mstar::kv
