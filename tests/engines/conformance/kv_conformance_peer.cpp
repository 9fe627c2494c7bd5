// Copyright mstar-kv authors.
//
// The serving side of the conformance suite, as its own process: builds a
// cache for the named engine, fills sequence 1 with the pattern, prints
// "SEQ <hex>" and keeps its engine alive until stdin says "quit" or closes.
// Page reuse (the page epoch tests): "next <delay_us>" waits that long,
// releases the current sequence, allocates the next id on the same pages
// (the free list is LIFO), fills them with seed + id and prints its "SEQ".
// "lease <ms>" before anything else is the pool's lease; "expire" reaps.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "mstar/kv/kv.hpp"
#include "peer_process.hpp"

using namespace mstar::kv;

int main(int argc, char** argv) {
  std::string engine;
  std::string layout_s;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter = 0;
  std::chrono::milliseconds lease = KVCachePool::kDefaultLease;
  EngineOptions options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--engine") engine = v;
    else if (k == "--layout") layout_s = v;
    else if (k == "--tokens") tokens = std::stoull(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--scatter") scatter = std::stoull(v);
    else if (k == "--lease-ms") lease = std::chrono::milliseconds(std::stoll(v));
    else if (k == "--extra") {
      const auto eq = v.find('=');
      options.extra[v.substr(0, eq)] = v.substr(eq + 1);
    }
  }
  try {
    const KVLayout layout = testing::parse_layout_arg(layout_s);
    const MemoryKind kind = engine == "shm" ? MemoryKind::kSharedHost : MemoryKind::kHost;
    auto cache = make_kv_cache(layout, kind);
    KVTransferManager manager(TransferEngineInfo{"peer", "", engine, options}, cache);
    auto pool_ptr =
        std::make_shared<KVCachePool>(cache, manager.get_kv_transfer_info(), scatter, lease);
    KVCachePool& pool = *pool_ptr;
    manager.serve_done_notices(pool_ptr);  // UCX readers may say "done"
    auto pages = pool.allocate(1, tokens);
    fill_pattern(*cache, seed, pages, 0, tokens);
    std::cout << "SEQ " << testing::to_hex(pool.publish(1).encode()) << std::endl;
    std::uint64_t current = 1;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line.rfind("next ", 0) == 0) {
        const auto until = std::chrono::steady_clock::now() +
                           std::chrono::microseconds(std::stoull(line.substr(5)));
        while (std::chrono::steady_clock::now() < until) {
        }
        pool.release(current);
        ++current;
        pages = pool.allocate(current, tokens);
        fill_pattern(*cache, seed + current, pages, 0, tokens);
        std::cout << "SEQ " << testing::to_hex(pool.publish(current).encode()) << std::endl;
      } else if (line == "contains") {
        std::cout << "CONTAINS " << pool.contains(current) << std::endl;
      } else if (line == "expire") {
        std::cout << "EXPIRED " << pool.expire_leases() << std::endl;
      }
    }
    manager.cleanup();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (char& c : msg) {
      if (c == '\n') c = ' ';
    }
    std::cout << "ERR " << msg << std::endl;
    return 1;
  }
  return 0;
}
