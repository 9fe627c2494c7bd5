// Copyright mstar-kv authors.
#include "cuda_util.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <cstring>

namespace mstar::kv::cuda_ipc {

std::string error_text(cudaError_t err) {
  const char* name = cudaGetErrorName(err);
  const char* text = cudaGetErrorString(err);
  // Reset the last-error slot (sticky errors stay: they cannot be cleared).
  (void)cudaGetLastError();
  std::string out = name != nullptr ? name : "cudaError " + std::to_string(static_cast<int>(err));
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

void fail(StatusCode code, std::string_view what, cudaError_t err) {
  throw Error(code, std::string(what) + ": " + error_text(err));
}

void check_device(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) fail(StatusCode::kUnavailable, "cudaGetDeviceCount", err);
  if (device < 0 || device >= count) {
    throw Error(StatusCode::kUnavailable, "CUDA device " + std::to_string(device) +
                                              " out of range [0, " + std::to_string(count) +
                                              ") of the devices visible here");
  }
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    (void)cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != device) {
    const cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) {
      fail(StatusCode::kUnavailable, "cudaSetDevice(" + std::to_string(device) + ")", err);
    }
    switched_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (switched_ && previous_ >= 0) {
    if (cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
}

void device_uuid(int device, std::uint8_t out[16]) {
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    fail(StatusCode::kUnavailable, "cudaGetDeviceProperties(" + std::to_string(device) + ")", err);
  }
  static_assert(sizeof(prop.uuid.bytes) == 16);
  std::memcpy(out, prop.uuid.bytes, 16);
}

std::string uuid_string(const std::uint8_t uuid[16]) {
  char buf[64];
  std::snprintf(buf, sizeof buf,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", uuid[0],
                uuid[1], uuid[2], uuid[3], uuid[4], uuid[5], uuid[6], uuid[7], uuid[8], uuid[9],
                uuid[10], uuid[11], uuid[12], uuid[13], uuid[14], uuid[15]);
  return buf;
}

int device_with_uuid(const std::uint8_t uuid[16]) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  for (int d = 0; d < count; ++d) {
    std::uint8_t u[16];
    try {
      device_uuid(d, u);
    } catch (const Error&) {
      continue;
    }
    if (std::memcmp(u, uuid, 16) == 0) return d;
  }
  return -1;
}

namespace {

// A driver entry point by name, or null. 12000: the ABI of these calls as of
// CUDA 12.0 (cuMemGetAddressRange_v2, cuPointerGetAttribute), which every
// driver able to run this CUDA 12/13 runtime provides.
void* driver_entry(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return status == cudaDriverEntryPointSuccess ? fn : nullptr;
}

}  // namespace

bool allocation_range(const void* ptr, AddressRange* out) {
  auto fn = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(driver_entry("cuMemGetAddressRange"));
  if (fn == nullptr) return false;
  CUdeviceptr base = 0;
  std::size_t size = 0;
  const CUresult r = fn(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    throw Error(StatusCode::kInvalidArgument,
                "pointer " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                    " is not inside a CUDA device allocation (cuMemGetAddressRange: CUresult " +
                    std::to_string(static_cast<int>(r)) + ")");
  }
  out->base = static_cast<std::uintptr_t>(base);
  out->size = size;
  return true;
}

int legacy_ipc_capable(const void* ptr) {
  auto fn =
      reinterpret_cast<PFN_cuPointerGetAttribute_v4000>(driver_entry("cuPointerGetAttribute"));
  if (fn == nullptr) return -1;
  // Documented as "a boolean"; read it into a zeroed wider word so that a
  // 1-byte bool or a 4-byte int both come out right.
  unsigned long long value = 0;
  const CUresult r = fn(&value, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                        reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) return -1;
  return value != 0 ? 1 : 0;
}

}  // namespace mstar::kv::cuda_ipc
