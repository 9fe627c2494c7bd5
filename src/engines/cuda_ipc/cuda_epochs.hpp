// Copyright mstar-kv authors.
//
// Page epochs for device caches (epochs.hpp, cuda_ipc.hpp "Page epochs").
// The pool stamps the cache's host table as for every cache; DeviceEpochTable
// mirrors it into a small cudaMalloc allocation of its own (one 8-byte word
// per page) with its own legacy IPC handle, which the descriptor carries, so
// that readers in other processes can check it. Readers copy the words of
// the pages they read to the host before their copies and again after the
// copies completed (the seqlock), and fail the read if any changed.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cuda_ipc {

class DeviceEpochTable final : public EpochMirror {
 public:
  // Zero-filled (every page free). Throws Error(kUnavailable /
  // kRetryLater) when the device cannot allocate or share it.
  DeviceEpochTable(std::uint32_t num_pages, int device);
  ~DeviceEpochTable() override;
  DeviceEpochTable(const DeviceEpochTable&) = delete;
  DeviceEpochTable& operator=(const DeviceEpochTable&) = delete;

  // Copies words [min(pages), max(pages)] to the device on a private
  // stream and waits for the copy to land (cudaStreamSynchronize: the DMA
  // is done, not only staged), so the model's later kernels that write the
  // pages come after it. A CUDA failure is printed to stderr once and makes
  // failed() true; readers then see an old epoch, and their copies on the
  // same broken device fail too.
  void push(const std::uint64_t* words,
            std::span<const std::uint32_t> pages) const noexcept override;

  const std::array<std::uint8_t, CudaIpcShare::kHandleBytes>& handle() const noexcept {
    return handle_;
  }
  std::uint32_t num_pages() const noexcept { return num_pages_; }
  const std::uint64_t* device_words() const noexcept { return words_; }
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

 private:
  std::uint64_t* words_ = nullptr;  // device memory
  std::uint32_t num_pages_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::array<std::uint8_t, CudaIpcShare::kHandleBytes> handle_{};
  mutable std::mutex mu_;  // one push at a time on stream_
  mutable std::atomic<bool> failed_{false};
};

// Reader side: copies the words of `pages` out of a device epoch table of
// `num_pages` words (an opened remote table, or a local one) on `stream`,
// waits, and checks them as check_page_epochs does (kStaleDescriptor naming
// the first page that changed owner and `when`); a CUDA failure is
// kPeerFailure. `scratch` is reused host memory.
Status check_device_epochs(const std::uint64_t* device_table, std::uint32_t num_pages,
                           std::span<const std::uint32_t> pages, std::uint64_t expect,
                           std::string_view when, bool after_copy, cudaStream_t stream,
                           std::vector<std::uint64_t>& scratch);

}  // namespace mstar::kv::cuda_ipc
