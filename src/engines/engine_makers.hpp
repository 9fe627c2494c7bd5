// Copyright mstar-kv authors.
//
// Constructors of the engines that are built, for the factory
// (src/engines/factory.cpp) only.
#pragma once

#include <memory>
#include <utility>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/engine.hpp"
#include "mstar/kv/engine_options.hpp"

namespace mstar::kv::engines {

// An engine class with every engine's constructor shape,
// Engine(cache, TransferEngineInfo) (shm, cuda_ipc, mooncake).
template <typename Engine>
std::unique_ptr<KVTransferEngine> make(std::shared_ptr<KVCache> cache,
                                       const TransferEngineInfo& info) {
  return std::make_unique<Engine>(std::move(cache), info);
}
// The UCX engine has no public class: an RMA engine over the UCX backend.
std::unique_ptr<KVTransferEngine> make_ucx_engine(std::shared_ptr<KVCache> cache,
                                                  const TransferEngineInfo& info);

// Memory providers, for make_kv_cache().
std::unique_ptr<KVMemory> allocate_shared_memory(std::size_t size, std::uint32_t num_pages);
std::unique_ptr<KVMemory> allocate_device_memory(std::size_t size, int device);

}  // namespace mstar::kv::engines
