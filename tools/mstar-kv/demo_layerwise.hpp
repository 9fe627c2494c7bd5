// Copyright mstar-kv authors.
//
// `mstar-kv demo --layerwise`: the prefill process writes each layer (a copy
// from a pattern made before the clock starts), then sleeps
// --prefill-ms-per-layer (a stand-in for the layer's compute) before marking
// it ready; the decode process streams it (start_streaming_retrieve)
// in some rounds and pulls after the prefill finished in the others (the
// baseline), alternating, and prints the time from prefill start to "all KV
// at decode" for both and the fraction of the transfer hidden under compute.
#pragma once

#include <chrono>
#include <cstdint>

#include "mstar/kv/layout.hpp"
#include "mstar/kv/manager.hpp"

namespace mstar::kv::cli::demo {

struct LayerwiseConfig {
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t scatter_seed = 0;  // 0: contiguous pages
  double ms_per_layer = 0;
  std::uint32_t rounds = 5;        // of each mode
  std::chrono::milliseconds timeout{30000};
  int fd = -1;                     // the channel to the other role
  MemoryKind memory = MemoryKind::kHost;
  TransferEngineInfo engine;
};

int run_layerwise_prefill(const LayerwiseConfig& c);
int run_layerwise_decode(const LayerwiseConfig& c);

}  // namespace mstar::kv::cli::demo
