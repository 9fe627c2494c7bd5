// Copyright mstar-kv authors.
#include "device_copier.hpp"

#include <algorithm>
#include <string>

#include "core/span_table.hpp"
#include "cuda_util.hpp"

namespace mstar::kv::cuda_ipc {

namespace {

// Free pinned buffers and table slots kept per copier: a read's pipeline
// takes a few of each and gives them back when it ends.
constexpr std::size_t kKeptFree = 16;

}  // namespace

// A pinned, mapped host buffer, given back to its copier's free list.
class DeviceCopier::Pinned final : public staging::Buffer {
 public:
  Pinned(std::shared_ptr<DeviceCopier> owner, std::byte* block, std::size_t size)
      : owner_(std::move(owner)), block_(block), size_(size) {}
  ~Pinned() override { owner_->give_block(block_, size_); }
  std::byte* data() const noexcept override { return block_; }
  std::size_t size() const noexcept override { return size_; }

 private:
  std::shared_ptr<DeviceCopier> owner_;
  std::byte* block_;
  std::size_t size_;
};

// One enqueued launch: done when its event is.
class DeviceCopier::Launch final : public staging::Job {
 public:
  Launch(std::shared_ptr<DeviceCopier> owner, std::unique_ptr<TableSlot> slot, cudaEvent_t event)
      : owner_(std::move(owner)), slot_(std::move(slot)), event_(event) {}
  ~Launch() override {
    (void)wait();  // the table slot is not reused while the upload may read it
    DeviceGuard guard(owner_->device_);
    if (cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
  }
  std::optional<Status> poll() override {
    if (result_) return result_;
    DeviceGuard guard(owner_->device_);
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    finish(err);
    return result_;
  }
  Status wait() override {
    if (result_) return *result_;
    DeviceGuard guard(owner_->device_);
    finish(cudaEventSynchronize(event_));
    return *result_;
  }

 private:
  void finish(cudaError_t err) {
    result_ = err == cudaSuccess
                  ? Status::ok()
                  : Status(StatusCode::kInternal, "a staging copy on device " +
                                                      std::to_string(owner_->device_) +
                                                      " failed: " + error_text(err));
    owner_->give_slot(std::move(slot_));
  }
  std::shared_ptr<DeviceCopier> owner_;
  std::unique_ptr<TableSlot> slot_;
  cudaEvent_t event_;
  std::optional<Status> result_;
};

std::shared_ptr<DeviceCopier> DeviceCopier::create(int device) {
  if (!span_kernel_built()) {
    throw Error(StatusCode::kUnavailable,
                "staging device memory needs the cuda_ipc copy kernel, which this build lacks "
                "(no CUDA compiler, or MSTAR_KV_CUDA_IPC_KERNEL=OFF)");
  }
  return std::shared_ptr<DeviceCopier>(new DeviceCopier(device));
}

DeviceCopier::DeviceCopier(int device) : device_(device) {
  check_device(device);
  DeviceGuard guard(device);
  blocks_ = span_kernel_blocks(device);
  const cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (err != cudaSuccess) fail(StatusCode::kUnavailable, "cudaStreamCreate for staging", err);
}

DeviceCopier::~DeviceCopier() {
  DeviceGuard guard(device_);
  if (stream_ != nullptr && cudaStreamSynchronize(stream_) != cudaSuccess) {
    (void)cudaGetLastError();
  }
  if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) (void)cudaGetLastError();
  slots_.clear();
  for (auto& [block, bytes] : blocks_free_) {
    if (cudaFreeHost(block) != cudaSuccess) (void)cudaGetLastError();
  }
}

std::unique_ptr<staging::Buffer> DeviceCopier::allocate(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  {
    std::lock_guard lk(mu_);
    // The smallest free buffer that holds `bytes`.
    auto best = blocks_free_.end();
    for (auto it = blocks_free_.begin(); it != blocks_free_.end(); ++it) {
      if (it->second >= bytes && (best == blocks_free_.end() || it->second < best->second)) {
        best = it;
      }
    }
    if (best != blocks_free_.end()) {
      const auto [block, size] = *best;
      blocks_free_.erase(best);
      return std::make_unique<Pinned>(shared_from_this(), block, size);
    }
  }
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    fail(StatusCode::kInternal,
         "cudaHostAlloc of a " + std::to_string(bytes) + "-byte staging buffer", err);
  }
  return std::make_unique<Pinned>(shared_from_this(), static_cast<std::byte*>(p), bytes);
}

void DeviceCopier::give_block(std::byte* block, std::size_t bytes) {
  {
    std::lock_guard lk(mu_);
    if (blocks_free_.size() < kKeptFree) {
      blocks_free_.emplace_back(block, bytes);
      return;
    }
  }
  DeviceGuard guard(device_);
  if (cudaFreeHost(block) != cudaSuccess) (void)cudaGetLastError();
}

std::unique_ptr<TableSlot> DeviceCopier::take_slot(std::size_t bytes) {
  {
    std::lock_guard lk(mu_);
    for (auto it = slots_.begin(); it != slots_.end(); ++it) {
      if ((*it)->capacity() >= bytes) {
        auto slot = std::move(*it);
        slots_.erase(it);
        return slot;
      }
    }
  }
  DeviceGuard guard(device_);
  return std::make_unique<TableSlot>(bytes);  // throws Error(kInternal)
}

void DeviceCopier::give_slot(std::unique_ptr<TableSlot> slot) {
  if (!slot) return;
  std::lock_guard lk(mu_);
  if (slots_.size() < kKeptFree) slots_.push_back(std::move(slot));
  // else freed here (TableSlot's destructor)
}

std::unique_ptr<staging::Job> DeviceCopier::gather(const RegionMap& cache,
                                                   std::span<const StridedSpan> spans,
                                                   staging::Buffer& into) {
  return launch(cache, spans, into.data(), walk::Packing::kDestination);
}

std::unique_ptr<staging::Job> DeviceCopier::scatter(const staging::Buffer& from,
                                                    std::span<const StridedSpan> spans,
                                                    const RegionMap& cache) {
  return launch(cache, spans, from.data(), walk::Packing::kSource);
}

std::unique_ptr<staging::Job> DeviceCopier::launch(const RegionMap& cache,
                                                   std::span<const StridedSpan> spans,
                                                   std::byte* buffer, walk::Packing packing) {
  // The cache side's offsets from one base: a cache of one region per
  // layer is rebased onto its lowest region (all in one address space).
  std::uint64_t base = cache.base(0);
  std::vector<StridedSpan> rebased;
  if (cache.split()) {
    for (std::size_t i = 1; i < cache.count(); ++i) base = std::min(base, cache.base(i));
    rebased.assign(spans.begin(), spans.end());
    for (StridedSpan& s : rebased) {
      std::uint64_t& at = packing == walk::Packing::kDestination ? s.remote_offset : s.local_offset;
      at = cache.address(at) - base;
    }
    spans = rebased;
  }
  DeviceGuard guard(device_);
  void* mapped = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&mapped, buffer, 0);
  if (err != cudaSuccess) fail(StatusCode::kInternal, "cudaHostGetDevicePointer of a buffer", err);
  const walk::TableSize size = walk::measure_table(spans);
  const std::size_t bytes = walk::table_bytes(size);
  std::unique_ptr<TableSlot> slot = take_slot(bytes);
  const walk::WalkTable table =
      walk::write_table(spans, packing, 0, size, slot->host(), slot->device());
  auto* cache_base = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(base));
  auto* packed = static_cast<std::byte*>(mapped);
  const bool to_buffer = packing == walk::Packing::kDestination;
  cudaEvent_t event = nullptr;
  err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    give_slot(std::move(slot));
    fail(StatusCode::kInternal, "cudaEventCreate for a staging copy", err);
  }
  err = cudaMemcpyAsync(slot->device(), slot->host(), bytes, cudaMemcpyHostToDevice, stream_);
  if (err == cudaSuccess) {
    err = launch_span_copy(table, to_buffer ? cache_base : packed, to_buffer ? packed : cache_base,
                           blocks_, stream_);
  }
  if (err == cudaSuccess) err = cudaEventRecord(event, stream_);
  if (err != cudaSuccess) {
    // What was enqueued finishes before the slot is reused or this throws.
    if (cudaStreamSynchronize(stream_) != cudaSuccess) (void)cudaGetLastError();
    (void)cudaEventDestroy(event);
    give_slot(std::move(slot));
    fail(StatusCode::kInternal,
         "a staging copy over " + std::to_string(size.entries) + " spans (" +
             std::to_string(size.bytes) + " bytes)",
         err);
  }
  return std::make_unique<Launch>(shared_from_this(), std::move(slot), event);
}

}  // namespace mstar::kv::cuda_ipc
