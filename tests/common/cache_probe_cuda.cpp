// Copyright mstar-kv authors.
//
// The cache probe's device side, in builds with the cuda_ipc engine.
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "common/cache_probe.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::testing {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(StatusCode::kInternal, std::string(what) + ": " + cudaGetErrorName(err));
  }
}

}  // namespace

std::string no_device_reason() { return cuda_unavailable_reason(); }

void device_to_host(const KVCache& dev, std::byte* out) {
  check(cudaMemcpy(out, dev.base(), dev.size_bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

void host_to_device(const std::byte* in, const KVCache& dev) {
  check(cudaMemcpy(dev.base(), in, dev.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

void device_memset(const KVCache& dev, std::byte value) {
  check(cudaMemset(dev.base(), static_cast<int>(value), dev.size_bytes()), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace mstar::kv::testing
