// Copyright mstar-kv authors.
//
// What each engine folder gives the factory (src/engines/factory.cpp): its
// hooks, defined in the engine's own target as engines::hooks_<name>(). The
// factory calls the hooks of the engines CMake built (the generated
// engine_registry.inc lists them); it never names an engine's classes.
#pragma once

#include <memory>
#include <utility>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"

namespace mstar::kv::engines {

struct EngineHooks {
  // Makes the engine over `cache` (every engine's shape).
  std::unique_ptr<KVTransferEngine> (*make)(std::shared_ptr<KVCache> cache,
                                            const TransferEngineInfo& info) = nullptr;
  // Zero-filled memory of the kind the engine serves for make_kv_cache()
  // (shm: shared host memory; cuda_ipc: device memory on `device`); null
  // when the engine serves caches of any host memory.
  std::unique_ptr<KVMemory> (*allocate)(const KVLayout& layout, int device) = nullptr;
};

// An engine class with every engine's constructor shape,
// Engine(cache, TransferEngineInfo).
template <typename Engine>
std::unique_ptr<KVTransferEngine> make(std::shared_ptr<KVCache> cache,
                                       const TransferEngineInfo& info) {
  return std::make_unique<Engine>(std::move(cache), info);
}

// One per engine folder; only those of built engines are defined.
EngineHooks hooks_shm();
EngineHooks hooks_ucx();
EngineHooks hooks_mooncake();
EngineHooks hooks_cuda_ipc();

}  // namespace mstar::kv::engines
