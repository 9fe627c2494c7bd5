// Copyright mstar-kv authors.
//
// A deterministic KV pattern and its verifier, shared by the demo, the tests,
// the benchmark and the soak.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "mstar/kv/core/cache.hpp"

namespace mstar::kv {

// The value of every (layer, k|v, token, head) row depends only on the seed
// and those logical coordinates (the head as the model numbers it: layout.hpp
// first_kv_head), never on the physical page or the layout's orders, so a
// cache filled on one side can be verified on the other whatever the page
// tables and layouts. Host memory only. Safe from any thread on disjoint
// pages.

// Writes the pattern for tokens [start_len, end_len) of a sequence whose
// page table is `pages` (entry i holds tokens [i*page_size, (i+1)*page_size)).
void fill_pattern(const KVCache& cache, std::uint64_t seed, std::span<const std::uint32_t> pages,
                  std::uint64_t start_len, std::uint64_t end_len);

// The same for layers [layer_begin, layer_end) only (a layer-wise writer, as
// a prefill that marks layers ready one by one). Throws Error naming the
// range when it exceeds the layout's layers.
void fill_pattern_layers(const KVCache& cache, std::uint64_t seed,
                         std::span<const std::uint32_t> pages, std::uint64_t start_len,
                         std::uint64_t end_len, std::uint32_t layer_begin, std::uint32_t layer_end);

struct VerifyResult {
  std::uint64_t blocks_checked = 0;  // (layer, k|v, page) checksums compared
  std::uint64_t bytes_checked = 0;
  std::uint64_t mismatched_blocks = 0;
  std::uint64_t checksum = 0;  // combined checksum of what was read
  std::string first_mismatch;  // "layer 3 v page 17 (seq page 2): ..."

  bool ok() const noexcept { return mismatched_blocks == 0; }
};

// Compares, block by block, the checksum of what the cache holds for tokens
// [start_len, end_len) with the checksum of the pattern.
VerifyResult verify_pattern(const KVCache& cache, std::uint64_t seed,
                            std::span<const std::uint32_t> pages, std::uint64_t start_len,
                            std::uint64_t end_len);

}  // namespace mstar::kv
