// Copyright mstar-kv authors.
//
// The cache probe's device side in builds without the cuda_ipc engine: no
// device cache can exist, so every call says so.
#include <string>

#include "common/cache_probe.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::testing {

namespace {

[[noreturn]] void unavailable() {
  throw Error(StatusCode::kUnavailable,
              "device caches need the cuda_ipc engine, which is not built");
}

}  // namespace

std::string no_device_reason() { return "the cuda_ipc engine is not built"; }
void device_to_host(const KVCache&, std::byte*) { unavailable(); }
void host_to_device(const std::byte*, const KVCache&) { unavailable(); }
void device_memset(const KVCache&, std::byte) { unavailable(); }

}  // namespace mstar::kv::testing
