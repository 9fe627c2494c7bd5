// Copyright mstar-kv authors.
//
// The layer watch of the same-host engines (internal): readiness and epoch
// words that this process maps from the owner (shm: the owner's cache file;
// cuda_ipc: the owner's host tables), read with plain loads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// check_layer_readiness over `pages` (which must carry `epoch`) on every
// poll; while layers are missing, check_owner() at most once per millisecond
// (it costs syscalls): its error, with how many layers were marked, ends the
// watch. `keep` keeps the mapping of the words alive.
std::unique_ptr<LayerWatch> make_mapped_layer_watch(
    const std::uint32_t* ready, const std::uint64_t* epochs, std::uint32_t num_pages,
    std::uint32_t num_layers, std::vector<std::uint32_t> pages, std::uint64_t epoch,
    std::function<Status()> check_owner, std::shared_ptr<const void> keep);

}  // namespace mstar::kv
