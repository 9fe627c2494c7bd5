// Copyright mstar-kv authors.
//
// The serving side of the conformance suite, as its own process: builds a
// cache for the named engine, fills sequence 1 with the pattern, prints
// "SEQ <hex>" and keeps its engine alive until stdin says "quit" or closes.
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
  EngineOptions options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--engine") engine = v;
    else if (k == "--layout") layout_s = v;
    else if (k == "--tokens") tokens = std::stoull(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--scatter") scatter = std::stoull(v);
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
    KVCachePool pool(cache, manager.get_kv_transfer_info(), scatter);
    auto pages = pool.allocate(1, tokens);
    fill_pattern(*cache, seed, pages, 0, tokens);
    std::cout << "SEQ " << testing::to_hex(pool.publish(1).encode()) << std::endl;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
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
