// Copyright mstar-kv authors.
//
// The copy kernel of the cuda_ipc engine (span_kernel.cu, compiled by nvcc
// when CMake finds a CUDA compiler): one launch moves every span of a span
// table (core/span_table.hpp), walking it as core/span_walk.hpp says, and
// the device copies of span tables (pinned staging, one upload per read).
// Private to the engine; plain C++ callers (no CUDA language needed). Kept
// to C++17 and the walk's header: nvcc compiles it too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/span_walk.hpp"

namespace mstar::kv::cuda_ipc {

// True when this build has the kernel (MSTAR_KV_CUDA_IPC_KERNEL).
bool span_kernel_built() noexcept;

// Enqueues one launch of the copy kernel on `stream`: every unit of `table`
// (whose pointers are device memory) from src_base to dst_base, on at most
// max_blocks blocks (>= 1). Nothing for an empty table. Returns the launch's
// error (cudaErrorNotSupported when the kernel is not built).
cudaError_t launch_span_copy(const walk::WalkTable& table, const std::byte* src_base,
                             std::byte* dst_base, unsigned max_blocks, cudaStream_t stream);

// The blocks a launch on `device` uses at most: enough to fill it (8 per
// multiprocessor).
unsigned span_kernel_blocks(int device);

// A span table's home for one read: a pinned host block the table is
// written into and a device block it is uploaded to (one cudaMemcpyAsync).
// Owned by one read from upload until the read's event completed. Not
// copyable; frees both blocks (the caller makes the device current).
class TableSlot {
 public:
  // Blocks of at least `bytes` (rounded up to a power of two >= 64 KiB).
  // Throws Error(kInternal) naming the CUDA error when either allocation fails.
  explicit TableSlot(std::size_t bytes);
  ~TableSlot();
  TableSlot(const TableSlot&) = delete;
  TableSlot& operator=(const TableSlot&) = delete;

  std::size_t capacity() const noexcept { return capacity_; }
  std::byte* host() const noexcept { return host_; }
  std::byte* device() const noexcept { return device_; }

 private:
  std::size_t capacity_ = 0;
  std::byte* host_ = nullptr;
  std::byte* device_ = nullptr;
};

}  // namespace mstar::kv::cuda_ipc
