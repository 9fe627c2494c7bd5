// Copyright mstar-kv authors.
//
// The Mooncake engine's layer watch (readiness.hpp), by bounded polling:
// Mooncake has no notification a reader could wait on over every transport,
// so the watch reads the owner's registered epoch and readiness words of
// its pages (the epochs, the words, the epochs again: the seqlock of
// readiness.hpp; three batches of a few requests each, the words read in
// runs, mooncake_words.hpp) at most every 0.5 ms, one round outstanding,
// into its registered scratch memory; poll() returns what the last round
// saw and starts the next one. Private to the Mooncake engine.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake_backend.hpp"
#include "mstar/kv/core/readiness.hpp"

namespace mstar::kv::mooncake {

// A round's failure is the watch's error: kPeerFailure (a read failed: the
// owner is gone or stopped serving), kStaleDescriptor (a page changed
// owner), kCorruptDescriptor (a word beyond num_layers or going backwards).
std::unique_ptr<LayerWatch> make_layer_watch(MooncakeBackend& backend, McSegmentId segment,
                                             std::string who, std::uint64_t epochs_ptr,
                                             std::uint64_t ready_ptr,
                                             std::shared_ptr<std::atomic<bool>> failed,
                                             std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers);

}  // namespace mstar::kv::mooncake
