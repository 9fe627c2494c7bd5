// Copyright mstar-kv authors.
//
// A real peer process for the shm engine tests. It owns a shared cache (or,
// with --reader, only reads others'), and speaks lines on stdin/stdout:
//   out "SEQ <hex SequenceInfo>"   after start (owner) and after "regen"
//   in  "regen"        free the cache and allocate, fill and publish a new one
//   in  "pullloop <hex>"  (reader) pull that sequence again and again;
//                      prints "LOOPING" after the first verified pull
//   in  "quit"         exit 0 (also on EOF)
// Errors print "ERR <message>" and exit 1.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "mstar/kv/kv.hpp"
#include "shm_test_util.hpp"

using namespace mstar::kv;

namespace {

struct Owner {
  std::shared_ptr<KVCache> cache;
  std::unique_ptr<KVTransferManager> manager;
  std::unique_ptr<KVCachePool> pool;
};

std::unique_ptr<Owner> make_owner(const KVLayout& l, std::uint64_t tokens, std::uint64_t seed,
                                  std::uint64_t scatter) {
  auto o = std::make_unique<Owner>();
  o->cache = make_kv_cache(l, MemoryKind::kSharedHost);
  o->manager = std::make_unique<KVTransferManager>(
      TransferEngineInfo{"peer", "", "shm", EngineOptions{}}, o->cache);
  o->pool = std::make_unique<KVCachePool>(o->cache, o->manager->get_kv_transfer_info(), scatter);
  auto pages = o->pool->allocate(1, tokens);
  fill_pattern(*o->cache, seed, pages, 0, tokens);
  std::cout << "SEQ " << shmtest::to_hex(o->pool->publish(1).encode()) << std::endl;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  std::string layout_s;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter = 0;
  bool reader = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--reader") {
      reader = true;
      continue;
    }
    if (i + 1 >= argc) break;
    const std::string v = argv[++i];
    if (k == "--layout") layout_s = v;
    else if (k == "--tokens") tokens = std::stoull(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--scatter") scatter = std::stoull(v);
  }
  try {
    const KVLayout layout = shmtest::parse_layout(layout_s);
    std::unique_ptr<Owner> owner;
    if (!reader) owner = make_owner(layout, tokens, seed, scatter);
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line == "regen" && owner) {
        owner.reset();  // the old memfd is closed and unmapped here
        owner = make_owner(layout, tokens, seed, scatter);
      } else if (line.rfind("pullloop ", 0) == 0) {
        const SequenceInfo seq = SequenceInfo::decode(shmtest::from_hex(line.substr(9)));
        auto cache = make_kv_cache(layout, MemoryKind::kHost);
        KVTransferManager m(TransferEngineInfo{"reader", "", "shm", EngineOptions{}}, cache);
        std::vector<std::uint32_t> lp(seq.page_indices.size());
        for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(i);
        for (bool first = true;; first = false) {
          m.sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
          if (first) {
            if (!verify_pattern(*cache, seed, lp, 0, seq.num_tokens).ok()) {
              throw Error(StatusCode::kInternal, "pulled bytes do not verify");
            }
            std::cout << "LOOPING" << std::endl;
          }
        }
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
  return 0;
}
