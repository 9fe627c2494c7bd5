// Copyright mstar-kv authors.
//
// DeviceCopier: the staging copier of device memory (core/staging.hpp), for
// engines whose transport cannot touch GPU memory (ucx, ucx_staging). Its
// buffers are pinned, mapped host memory (cudaHostAlloc, kept for reuse);
// each gather or scatter is one upload of the message's span table and one
// launch of the copy kernel (span_kernel.hpp) reading the device cache and
// writing the buffer (or the reverse) across the bus, then an event: no
// copy per span, whatever the geometry. Jobs of one copier run in order on
// its stream. Thread safety: any thread (a mutex guards the free lists).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "core/span_table.hpp"
#include "core/staging.hpp"
#include "span_kernel.hpp"

namespace mstar::kv::cuda_ipc {

class DeviceCopier final : public staging::Copier,
                           public std::enable_shared_from_this<DeviceCopier> {
 public:
  // Throws Error(kUnavailable) when the copy kernel is not built or the
  // device cannot be used, naming why.
  static std::shared_ptr<DeviceCopier> create(int device);
  ~DeviceCopier() override;
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  std::unique_ptr<staging::Buffer> allocate(std::size_t bytes) override;
  std::unique_ptr<staging::Job> gather(const RegionMap& cache, std::span<const StridedSpan> spans,
                                       staging::Buffer& into) override;
  std::unique_ptr<staging::Job> scatter(const staging::Buffer& from,
                                        std::span<const StridedSpan> spans,
                                        const RegionMap& cache) override;

  int device() const noexcept { return device_; }

 private:
  class Pinned;
  class Launch;
  explicit DeviceCopier(int device);
  // One launch over `spans`, the packed side at `buffer`; throws Error only
  // when nothing was enqueued.
  std::unique_ptr<staging::Job> launch(const RegionMap& cache, std::span<const StridedSpan> spans,
                                       std::byte* buffer, walk::Packing packing);
  std::unique_ptr<TableSlot> take_slot(std::size_t bytes);
  void give_slot(std::unique_ptr<TableSlot> slot);
  void give_block(std::byte* block, std::size_t bytes);

  int device_ = 0;
  unsigned blocks_ = 1;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::vector<std::unique_ptr<TableSlot>> slots_;                // free span-table slots
  std::vector<std::pair<std::byte*, std::size_t>> blocks_free_;  // free pinned buffers
};

}  // namespace mstar::kv::cuda_ipc
