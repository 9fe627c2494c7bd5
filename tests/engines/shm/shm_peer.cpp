// Copyright mstar-kv authors.
//
// A real peer process for the shm engine tests. It owns a shared cache (or,
// with --reader, only reads others'), and speaks lines on stdin/stdout:
//   out "SEQ <hex SequenceInfo>"   after start (owner) and after "regen"
//   in  "regen"        free the cache and allocate, fill and publish a new one
//   in  "pullloop <hex>"  (reader) pull that sequence again and again;
//                      prints "LOOPING" after the first verified pull
//   in  "tryopen <hex>"  (reader) read that sequence with the descriptor's
//                      uid replaced by this process's; prints "CODE <status>
//                      <message>" (with --as-uid, the kernel's check is
//                      what must refuse)
//   in  "quit"         exit 0 (also on EOF)
// --as-uid N drops to that uid and gid first (needs root).
// Errors print "ERR <message>" and exit 1.
#include <grp.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "mstar/kv/kv.hpp"
#include "mstar/kv/shm.hpp"
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
  long as_uid = -1;
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
    else if (k == "--as-uid") as_uid = std::stol(v);
  }
  if (as_uid >= 0) {
    const auto id = static_cast<uid_t>(as_uid);
    if (::setgroups(0, nullptr) != 0 || ::setgid(id) != 0 || ::setuid(id) != 0) {
      std::cout << "ERR cannot switch to uid " << as_uid << std::endl;
      return 1;
    }
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
      } else if (line.rfind("tryopen ", 0) == 0) {
        const SequenceInfo seq = SequenceInfo::decode(shmtest::from_hex(line.substr(8)));
        ShmKVTransferInfo info = ShmKVTransferInfo::decode(seq.kv_transfer_info);
        info.uid = static_cast<std::uint32_t>(::geteuid());  // pretend it is ours
        auto cache = make_kv_cache(layout, MemoryKind::kHost);
        KVTransferManager m(TransferEngineInfo{"reader", "", "shm", EngineOptions{}}, cache);
        std::vector<std::uint32_t> lp(seq.page_indices.size());
        for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(i);
        try {
          m.sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, info.encode());
          std::cout << "CODE Ok read" << std::endl;
        } catch (const Error& e) {
          std::string msg = e.status().message();
          for (char& c : msg) {
            if (c == '\n') c = ' ';
          }
          std::cout << "CODE " << to_string(e.code()) << " " << msg << std::endl;
        }
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
