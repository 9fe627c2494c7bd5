// Copyright mstar-kv authors.
#include "cuda_epochs.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_util.hpp"

namespace mstar::kv::cuda_ipc {

namespace {

// [lo, hi] of the in-range pages; false when none is in range.
bool page_range(std::span<const std::uint32_t> pages, std::uint32_t num_pages, std::uint32_t* lo,
                std::uint32_t* hi) {
  bool any = false;
  for (std::uint32_t p : pages) {
    if (p >= num_pages) continue;
    if (!any || p < *lo) *lo = p;
    if (!any || p > *hi) *hi = p;
    any = true;
  }
  return any;
}

}  // namespace

DeviceEpochTable::DeviceEpochTable(std::uint32_t num_pages, int device)
    : num_pages_(num_pages), device_(device) {
  DeviceGuard guard(device);
  const std::size_t bytes = std::max<std::size_t>(std::size_t{num_pages} * 8, 8);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    fail(err == cudaErrorMemoryAllocation ? StatusCode::kRetryLater : StatusCode::kUnavailable,
         "cudaMalloc of the " + std::to_string(bytes) + "-byte page epoch table on device " +
             std::to_string(device),
         err);
  }
  words_ = static_cast<std::uint64_t*>(p);
  try {
    err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (err != cudaSuccess) fail(StatusCode::kUnavailable, "cudaStreamCreateWithFlags", err);
    err = cudaMemsetAsync(p, 0, bytes, stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) fail(StatusCode::kInternal, "zero-filling the page epoch table", err);
    cudaIpcMemHandle_t h{};
    err = cudaIpcGetMemHandle(&h, p);
    if (err != cudaSuccess)
      fail(StatusCode::kUnavailable, "cudaIpcGetMemHandle of the page epoch table", err);
    std::memcpy(handle_.data(), h.reserved, handle_.size());
  } catch (...) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    (void)cudaFree(p);
    throw;
  }
}

DeviceEpochTable::~DeviceEpochTable() {
  try {
    DeviceGuard guard(device_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    if (words_ != nullptr && cudaFree(words_) != cudaSuccess) (void)cudaGetLastError();
  } catch (const Error&) {
    // The device is gone (driver torn down at exit): nothing left to free.
  }
}

void DeviceEpochTable::push(const std::uint64_t* words,
                            std::span<const std::uint32_t> pages) const noexcept {
  std::uint32_t lo = 0, hi = 0;
  if (!page_range(pages, num_pages_, &lo, &hi)) return;
  std::lock_guard<std::mutex> lk(mu_);
  cudaError_t err = cudaSuccess;
  try {
    DeviceGuard guard(device_);
    err = cudaMemcpyAsync(words_ + lo, words + lo, std::size_t{hi - lo + 1} * 8,
                          cudaMemcpyHostToDevice, stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  } catch (const Error&) {
    err = cudaErrorDevicesUnavailable;
  }
  if (err != cudaSuccess && !failed_.exchange(true)) {
    std::fprintf(stderr,
                 "mstar-kv cuda_ipc: pushing page epochs to device %d failed (%s); readers "
                 "of this cache can no longer detect reused pages\n",
                 device_, error_text(err).c_str());
  }
}

Status check_device_epochs(const std::uint64_t* device_table, std::uint32_t num_pages,
                           std::span<const std::uint32_t> pages, std::uint64_t expect,
                           std::string_view when, bool after_copy, cudaStream_t stream,
                           std::vector<std::uint64_t>& scratch) {
  scratch.assign(num_pages, 0);
  std::uint32_t lo = 0, hi = 0;
  if (page_range(pages, num_pages, &lo, &hi)) {
    cudaError_t err = cudaMemcpyAsync(scratch.data() + lo, device_table + lo,
                                      std::size_t{hi - lo + 1} * 8, cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
      return Status(StatusCode::kPeerFailure, "reading the owner's page epochs " +
                                                  std::string(when) + ": " + error_text(err));
    }
  }
  return check_page_epochs(scratch.data(), num_pages, pages, expect, when, after_copy);
}

}  // namespace mstar::kv::cuda_ipc
