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
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/kv.hpp"

namespace mstar::kv::cli::demo {

// Throws Error(kUnavailable) naming `engine` when its readers cannot see the
// owner's layer readiness (the engine traits' layer_readiness): the one place the CLI's
// --layerwise checks it (demo, serve, pull), before anything starts.
void require_layer_readiness(const std::string& engine);

// CLOCK_MONOTONIC (steady_clock on Linux) in ns: the clock both processes
// of a layer-wise run read.
inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Rounds alternate: even rounds stream, odd ones pull after the prefill.
inline bool streaming_round(std::uint32_t r) { return r % 2 == 0; }

// The owner's half of one layer-wise prefill of sequence `id` (published
// with 0 layers ready): for every layer, copy it from `staging` (the "model
// output", made before the clock starts) into `cache`, sleep
// `compute_per_layer` (a stand-in for the layer's compute: the CPU stays
// free for the reader's copies, as a GPU computes while the NIC copies),
// then pool.mark_layers_ready(id, layer + 1).
struct PrefillTiming {
  std::int64_t t0_ns = 0;           // steady clock at the start of layer 0
  std::int64_t compute_end_ns = 0;  // after the last layer was marked
  double mark_us = 0;               // mark_layers_ready, all layers together
  std::uint32_t marks = 0;
};
PrefillTiming prefill_layers(KVCache& cache, const KVCache& staging, KVCachePool& pool,
                             std::uint64_t id, std::span<const std::uint32_t> pages,
                             std::chrono::nanoseconds compute_per_layer);

// The reader's record of the rounds, in milliseconds, and the lines that
// demo --layerwise and pull --layerwise print from it.
struct LayerwiseSamples {
  std::vector<double> stream_end, stream_compute, stream_exposed;
  std::vector<double> pull_end, pull_compute, pull_transfer;
  // `end`: prefill start to all KV at decode; `compute`: that round's
  // prefill compute; `transfer`: after the prefill finished, to all KV.
  void add_stream(double end, double compute);
  void add_pull(double end, double compute, double transfer);
};
// The medians: compute, both end times, the transfer, the fraction hidden,
// and a "summary:" line.
void print_layerwise_report(const LayerwiseSamples& s, std::uint32_t num_layers);

struct LayerwiseConfig {
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t scatter_seed = 0;  // 0: contiguous pages
  double ms_per_layer = 0;
  std::uint32_t rounds = 5;  // of each mode
  std::chrono::milliseconds timeout{30000};
  int fd = -1;  // the channel to the other role
  MemoryKind memory = MemoryKind::kHost;
  TransferEngineInfo engine;
};

int run_layerwise_prefill(const LayerwiseConfig& c);
int run_layerwise_decode(const LayerwiseConfig& c);

}  // namespace mstar::kv::cli::demo
