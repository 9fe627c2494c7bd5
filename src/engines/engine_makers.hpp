// Copyright mstar-kv authors.
//
// Constructors of the engines that are built, for the factory
// (src/engines/factory.cpp) only. Each is defined in its engine's folder.
#pragma once

#include <memory>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/engine.hpp"
#include "mstar/kv/engine_options.hpp"

namespace mstar::kv::engines {

std::unique_ptr<KVTransferEngine> make_shm_engine(std::shared_ptr<KVCache> cache,
                                                  const TransferEngineInfo& info);
std::unique_ptr<KVTransferEngine> make_ucx_engine(std::shared_ptr<KVCache> cache,
                                                  const TransferEngineInfo& info);
std::unique_ptr<KVTransferEngine> make_mooncake_engine(std::shared_ptr<KVCache> cache,
                                                       const TransferEngineInfo& info);
std::unique_ptr<KVTransferEngine> make_cuda_ipc_engine(std::shared_ptr<KVCache> cache,
                                                       const TransferEngineInfo& info);

// Memory providers, for make_kv_cache().
std::unique_ptr<KVMemory> allocate_shared_memory(std::size_t size, std::uint32_t num_pages);
std::unique_ptr<KVMemory> allocate_device_memory(std::size_t size, int device);

}  // namespace mstar::kv::engines
