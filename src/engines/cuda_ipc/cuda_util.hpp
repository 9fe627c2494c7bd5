// Copyright mstar-kv authors.
//
// Private CUDA helpers of the cuda_ipc engine: error text, a current-device
// guard and the few driver-API calls the runtime lacks. Only this engine's
// sources include CUDA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cuda_ipc {

// "cudaErrorNoDevice (no CUDA-capable device is detected)". Clears the
// runtime's last-error slot, which a handled failure would otherwise leave
// for an unrelated later cudaGetLastError() (e.g. PyTorch's) to report.
std::string error_text(cudaError_t err);

// Throws Error(code, "<what>: <error_text(err)>").
[[noreturn]] void fail(StatusCode code, std::string_view what, cudaError_t err);

// Throws Error(kUnavailable) unless `device` is a visible device ordinal.
void check_device(int device);

// Makes `device` current for the scope and restores the caller's current
// device after. Never initialises a device the caller had not made current
// except `device` itself. Not copyable.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// The 16-byte UUID of a visible device (cudaDeviceProp::uuid); throws
// Error(kUnavailable) naming the CUDA error.
void device_uuid(int device, std::uint8_t out[16]);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
std::string uuid_string(const std::uint8_t uuid[16]);
// The visible ordinal with this UUID, or -1.
int device_with_uuid(const std::uint8_t uuid[16]);

// The allocation that contains `ptr`: cuMemGetAddressRange through
// cudaGetDriverEntryPointByVersion (no link-time dependency on libcuda, so
// that binaries start on hosts without an NVIDIA driver). Returns false when
// the driver lacks the call; throws Error(kInvalidArgument) when `ptr` is not
// in a device allocation.
struct AddressRange {
  std::uintptr_t base = 0;
  std::size_t size = 0;
};
bool allocation_range(const void* ptr, AddressRange* out);

// Whether legacy CUDA IPC (cudaIpcGetMemHandle) can share the allocation
// holding `ptr`: CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, false for
// VMM (cuMemCreate/cuMemMap) and memory-pool (cudaMallocAsync) allocations.
// Returns -1 when the driver cannot answer, else 0 or 1.
int legacy_ipc_capable(const void* ptr);

}  // namespace mstar::kv::cuda_ipc
