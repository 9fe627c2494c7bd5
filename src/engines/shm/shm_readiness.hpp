// Copyright mstar-kv authors.
//
// The shm engine's layer watch (readiness.hpp): the readiness words of a
// mapped owner cache (private to the shm engine).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mstar/kv/readiness.hpp"
#include "shm_mapping.hpp"

namespace mstar::kv::shm {

// Watches `pages` of `mapping` for a sequence published with `epoch`.
std::unique_ptr<LayerWatch> make_layer_watch(std::shared_ptr<const ShmMapping> mapping,
                                             std::vector<std::uint32_t> pages,
                                             std::uint64_t epoch);

}  // namespace mstar::kv::shm
