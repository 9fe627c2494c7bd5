// Copyright mstar-kv authors.
//
// The owner process of the cuda_ipc engine tests (cuda_ipc_owner): a real
// second process that exports a device cache. Device caches are filled and
// read through the cache probe (tests/common/cache_probe.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/cache_probe.hpp"
#include "common/layouts.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::cuda_test {

struct OwnerSpec {
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter_seed = 7;  // 0: contiguous pages
  std::uint64_t wrap_offset = 0;   // > 0: wrap a cudaMalloc at this byte offset
};

// cuda_ipc_owner as a child process (device 0 unless CUDA_VISIBLE_DEVICES
// says otherwise). It allocates a device cache, fills one sequence with the
// pattern and prints its SequenceInfo. The destructor kills and reaps it.
class OwnerProcess : public testing::Peer {
 public:
  explicit OwnerProcess(const OwnerSpec& spec,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // A new allocation (new generation) filled with `seed`; the old one stays
  // allocated (an owner must not free memory a reader may still map).
  const SequenceInfo& regenerate(std::uint64_t seed) {
    return command("regen " + std::to_string(seed));
  }
  // A second cache of another layout in the same process.
  const SequenceInfo& add_cache(std::uint64_t seed, const KVLayout& layout) {
    return command("regen " + std::to_string(seed) + " " + testing::layout_arg(layout));
  }
  // Page reuse: the owner releases the current sequence of its newest cache
  // and allocates the next sequence id on the freed pages, filled with
  // `seed`. send_reuse returns at once (the owner works while the caller
  // reads); await_sequence then waits for the new SequenceInfo.
  const SequenceInfo& reuse(std::uint64_t seed) { return command("reuse " + std::to_string(seed)); }
  void send_reuse(std::uint64_t seed) { send("reuse " + std::to_string(seed)); }
  const SequenceInfo& await_sequence() { return Peer::await_sequence(std::chrono::seconds(60)); }
};

}  // namespace mstar::kv::cuda_test
