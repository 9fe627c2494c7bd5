// Copyright mstar-kv authors.
//
// The host side of the copy kernel (span_kernel.hpp): table slots, the
// launch's grid, and the stand-in launch of a build without the kernel.
#include <string>

#include "cuda_util.hpp"
#include "span_kernel.hpp"

namespace mstar::kv::cuda_ipc {

bool span_kernel_built() noexcept { return MSTAR_KV_CUDA_IPC_KERNEL != 0; }

#if !MSTAR_KV_CUDA_IPC_KERNEL
cudaError_t launch_span_copy(const walk::WalkTable& table, const std::byte*, std::byte*, unsigned,
                             cudaStream_t) {
  return table.units == 0 ? cudaSuccess : cudaErrorNotSupported;
}
#endif

unsigned span_kernel_blocks(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    sms = 16;
  }
  return static_cast<unsigned>(sms) * 8;
}

TableSlot::TableSlot(std::size_t bytes) {
  capacity_ = std::size_t{64} << 10;
  while (capacity_ < bytes) capacity_ *= 2;
  void* h = nullptr;
  cudaError_t err = cudaHostAlloc(&h, capacity_, cudaHostAllocDefault);
  if (err != cudaSuccess) fail(StatusCode::kInternal, "cudaHostAlloc of a span table", err);
  void* d = nullptr;
  err = cudaMalloc(&d, capacity_);
  if (err != cudaSuccess) {
    (void)cudaFreeHost(h);
    fail(StatusCode::kInternal, "cudaMalloc of a span table", err);
  }
  host_ = static_cast<std::byte*>(h);
  device_ = static_cast<std::byte*>(d);
}

TableSlot::~TableSlot() {
  if (device_ != nullptr && cudaFree(device_) != cudaSuccess) (void)cudaGetLastError();
  if (host_ != nullptr && cudaFreeHost(host_) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace mstar::kv::cuda_ipc
