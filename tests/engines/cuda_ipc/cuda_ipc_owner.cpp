// Copyright mstar-kv authors.
//
// The exporting side of the cuda_ipc tests, as its own process: allocates a
// device cache (or wraps a cudaMalloc at an offset), fills sequence 1 with
// the pattern (staged through host memory), prints "SEQ <hex SequenceInfo>"
// and then serves until stdin says "quit" or closes. "regen <seed> [layout]"
// makes a new allocation (a new generation; of another layout if given)
// filled with <seed> and prints its SEQ; "reuse <seed>" releases the newest
// cache's current sequence, allocates the next sequence id on the freed
// pages (new page epochs), fills it with <seed> and prints its SEQ;
// earlier allocations stay alive until exit, since a reader may still have
// them open.
#include <cuda_runtime_api.h>

#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

using namespace mstar::kv;
using testing::say_sequence;

namespace {

struct Generation {
  void* raw = nullptr;  // the cudaMalloc behind a wrapped cache
  std::shared_ptr<KVCache> cache;
  std::unique_ptr<KVTransferManager> manager;
  std::unique_ptr<KVCachePool> pool;
  std::uint64_t seq_id = 1;

  ~Generation() {
    if (manager) manager->cleanup();
    manager.reset();
    pool.reset();
    cache.reset();
    if (raw != nullptr) (void)cudaFree(raw);
  }
};

std::unique_ptr<Generation> make_generation(const KVLayout& layout, std::uint64_t tokens,
                                            std::uint64_t seed, std::uint64_t scatter,
                                            std::uint64_t wrap_offset) {
  auto g = std::make_unique<Generation>();
  if (wrap_offset == 0) {
    g->cache = make_kv_cache(layout, MemoryKind::kDevice, 0);
  } else {
    const std::size_t bytes = layout.total_bytes() + wrap_offset + 4096;
    if (cudaMalloc(&g->raw, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    g->cache = wrap_device_cache(layout, static_cast<std::byte*>(g->raw) + wrap_offset,
                                 layout.total_bytes(), 0);
  }
  testing::fill_bytes(*g->cache, std::byte{0x5A});
  g->manager = std::make_unique<KVTransferManager>(TransferEngineInfo{"owner", "", "cuda_ipc", {}},
                                                   g->cache);
  g->pool = std::make_unique<KVCachePool>(g->cache, g->manager->get_kv_transfer_info(), scatter);
  const auto pages = g->pool->allocate(1, tokens);
  testing::fill_pattern_any(*g->cache, seed, pages, 0, tokens);
  // The pages are written (cudaMemcpy is synchronous): safe to publish.
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::unique_ptr<Generation>> generations;
  const int rc = testing::run_peer([&] {
    const testing::PeerArgs a = testing::parse_peer_args(argc, argv);
    const std::uint64_t wrap_offset =
        a.other.count("--wrap-offset") != 0 ? std::stoull(a.other.at("--wrap-offset")) : 0;
    generations.push_back(make_generation(a.layout, a.tokens, a.seed, a.scatter, wrap_offset));
    say_sequence(generations.back()->pool->publish(1));
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd == "regen") {
        std::uint64_t s = 0;
        std::string other;
        in >> s >> other;
        const KVLayout l = other.empty() ? a.layout : testing::parse_layout_arg(other);
        generations.push_back(make_generation(l, a.tokens, s, a.scatter, wrap_offset));
        say_sequence(generations.back()->pool->publish(1));
      } else if (cmd == "reuse") {
        std::uint64_t s = 0;
        in >> s;
        Generation& g = *generations.back();
        g.pool->release(g.seq_id);
        ++g.seq_id;
        const auto pages = g.pool->allocate(g.seq_id, a.tokens);
        testing::fill_pattern_any(*g.cache, s, pages, 0, a.tokens);
        say_sequence(g.pool->publish(g.seq_id));
      }
    }
    return 0;
  });
  generations.clear();
  return rc;
}
