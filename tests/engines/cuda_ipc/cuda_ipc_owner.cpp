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

#include "cuda_ipc_test_util.hpp"
#include "mstar/kv/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"

using namespace mstar::kv;

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
  cuda_test::fill_device_bytes(*g->cache, 0x5A);
  g->manager = std::make_unique<KVTransferManager>(
      TransferEngineInfo{"owner", "", "cuda_ipc", {}}, g->cache);
  g->pool = std::make_unique<KVCachePool>(g->cache, g->manager->get_kv_transfer_info(), scatter);
  const auto pages = g->pool->allocate(1, tokens);
  cuda_test::fill_device_pattern(*g->cache, seed, pages, 0, tokens);
  // The pages are written (cudaMemcpy is synchronous): safe to publish.
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  std::string layout_s;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter = 0;
  std::uint64_t wrap_offset = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--layout") layout_s = v;
    else if (k == "--tokens") tokens = std::stoull(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--scatter") scatter = std::stoull(v);
    else if (k == "--wrap-offset") wrap_offset = std::stoull(v);
  }
  std::vector<std::unique_ptr<Generation>> generations;
  try {
    const KVLayout layout = cuda_test::parse_layout_arg(layout_s);
    generations.push_back(make_generation(layout, tokens, seed, scatter, wrap_offset));
    std::cout << "SEQ " << cuda_test::to_hex(generations.back()->pool->publish(1).encode())
              << std::endl;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd == "regen") {
        std::uint64_t s = 0;
        std::string other;
        in >> s >> other;
        const KVLayout l = other.empty() ? layout : cuda_test::parse_layout_arg(other);
        generations.push_back(make_generation(l, tokens, s, scatter, wrap_offset));
        std::cout << "SEQ " << cuda_test::to_hex(generations.back()->pool->publish(1).encode())
                  << std::endl;
      } else if (cmd == "reuse") {
        std::uint64_t s = 0;
        in >> s;
        Generation& g = *generations.back();
        g.pool->release(g.seq_id);
        ++g.seq_id;
        const auto pages = g.pool->allocate(g.seq_id, tokens);
        cuda_test::fill_device_pattern(*g.cache, s, pages, 0, tokens);
        std::cout << "SEQ " << cuda_test::to_hex(g.pool->publish(g.seq_id).encode())
                  << std::endl;
      }
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (char& c : msg) {
      if (c == '\n') c = ' ';
    }
    std::cout << "ERR " << msg << std::endl;
    return 1;
  }
  generations.clear();
  return 0;
}
