// Copyright mstar-kv authors.
//
// The soak's prefill role (private to `mstar-kv soak`): its process, and
// after its first sequences are published, page reuse and lease expiry as
// faults.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "args.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/pool.hpp"

namespace mstar::kv::cli {

struct PrefillChurn {
  // Mean time between page reuses: a random live sequence is freed and a
  // new one is allocated (on the pages just freed), filled and published.
  // 0: no reuse.
  std::chrono::milliseconds reuse{0};
  std::uint64_t gen = 1;  // seq ids are gen * 1000 + n
  std::uint64_t max_tokens = 256;
  std::uint64_t first_free_id = 0;  // n of the next new sequence
};

// Serves until stdin closes. Every sequence whose lease expired (and every
// reused one) is replaced by a new one; `published` runs for each new one
// (the "SEQ <hex>" line); `seed_of` gives a sequence's pattern seed.
// The prefill role (`mstar-kv soak --role prefill`): publishes its
// sequences filled with their pattern, one "SEQ <hex>" line each, then
// "READY", and serves them (with churn) until stdin closes.
int run_soak_prefill(const Args& args);
// The soak's geometry: the layout flags over a small default (4 layers, 2
// heads x 64) with `pages` pages; and the flags that give a layout to a child.
KVLayout soak_layout(const Args& args, std::uint32_t pages);
std::vector<std::string> layout_flags(const KVLayout& l);

void serve_prefill_with_churn(KVCachePool& pool, const KVCache& cache,
                              std::vector<std::uint64_t> live, const PrefillChurn& cfg,
                              const std::function<std::uint64_t(std::uint64_t)>& seed_of,
                              const std::function<void(const SequenceInfo&)>& published);

}  // namespace mstar::kv::cli
