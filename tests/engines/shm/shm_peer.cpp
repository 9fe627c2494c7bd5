// Copyright mstar-kv authors.
//
// A real peer process for the shm engine tests. It owns a shared cache (with
// --private a private one, served by cross-memory attach; with --layers too
// a private one of one region per layer), or, with --reader, only reads
// others'; and speaks lines on stdin/stdout:
//   out "SEQ <hex SequenceInfo>"   after start (owner), "regen" and "reengine"
//   in  "regen"        free the cache and allocate, fill and publish a new one
//   in  "reengine"     a new engine and pool over the same cache (--private:
//                      a new anchor and nonce), filled and published again
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

#include <iostream>
#include <memory>
#include <string>

#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

using namespace mstar::kv;
using testing::say;

namespace {

struct Owner {
  std::shared_ptr<KVCache> cache;
  std::unique_ptr<KVTransferManager> manager;
  std::unique_ptr<KVCachePool> pool;
};

enum class OwnerMemory { kShared, kPrivate, kLayers };

std::shared_ptr<KVCache> owner_cache(const KVLayout& l, OwnerMemory memory) {
  switch (memory) {
    case OwnerMemory::kPrivate:
      return make_kv_cache(l, MemoryKind::kHost);
    case OwnerMemory::kLayers:
      return KVCache::create_host_layers(l);
    default:
      return make_kv_cache(l, MemoryKind::kSharedHost);
  }
}

std::unique_ptr<Owner> make_owner(const KVLayout& l, std::uint64_t tokens, std::uint64_t seed,
                                  std::uint64_t scatter, OwnerMemory memory,
                                  std::shared_ptr<KVCache> cache = nullptr) {
  auto o = std::make_unique<Owner>();
  o->cache = cache ? std::move(cache) : owner_cache(l, memory);
  o->manager = std::make_unique<KVTransferManager>(
      TransferEngineInfo{"peer", "", "shm", EngineOptions{}}, o->cache);
  o->pool = std::make_unique<KVCachePool>(o->cache, o->manager->get_kv_transfer_info(), scatter);
  auto pages = o->pool->allocate(1, tokens);
  fill_pattern(*o->cache, seed, pages, 0, tokens);
  testing::say_sequence(o->pool->publish(1));
  return o;
}

// A reader of `seq` into a private cache of `layout`, its pages 0, 1, ...
struct Reader {
  Reader(const KVLayout& layout, const SequenceInfo& seq)
      : cache(make_kv_cache(layout, MemoryKind::kHost)),
        manager(TransferEngineInfo{"reader", "", "shm", EngineOptions{}}, cache),
        pages(seq.page_indices.size()) {
    for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<std::uint32_t>(i);
  }
  std::shared_ptr<KVCache> cache;
  KVTransferManager manager;
  std::vector<std::uint32_t> pages;
};

SequenceInfo decode_hex(const std::string& hex) {
  return SequenceInfo::decode(testing::from_hex(hex));
}

}  // namespace

int main(int argc, char** argv) {
  return testing::run_peer([&] {
    const testing::PeerArgs a =
        testing::parse_peer_args(argc, argv, {"--reader", "--private", "--layers"});
    const OwnerMemory memory = a.flags.count("--layers") != 0    ? OwnerMemory::kLayers
                               : a.flags.count("--private") != 0 ? OwnerMemory::kPrivate
                                                                 : OwnerMemory::kShared;
    if (a.other.count("--as-uid") != 0) {
      const long as_uid = std::stol(a.other.at("--as-uid"));
      const auto id = static_cast<uid_t>(as_uid);
      if (::setgroups(0, nullptr) != 0 || ::setgid(id) != 0 || ::setuid(id) != 0) {
        throw std::runtime_error("cannot switch to uid " + std::to_string(as_uid));
      }
    }
    std::unique_ptr<Owner> owner;
    if (a.flags.count("--reader") == 0) {
      owner = make_owner(a.layout, a.tokens, a.seed, a.scatter, memory);
    }
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line == "regen" && owner) {
        owner.reset();  // the old memfd is closed and unmapped here
        owner = make_owner(a.layout, a.tokens, a.seed, a.scatter, memory);
      } else if (line == "reengine" && owner) {
        std::shared_ptr<KVCache> cache = owner->cache;
        owner.reset();  // the engine goes (with its anchor), the cache stays
        owner = make_owner(a.layout, a.tokens, a.seed, a.scatter, memory, std::move(cache));
      } else if (line.rfind("tryopen ", 0) == 0) {
        const SequenceInfo seq = decode_hex(line.substr(8));
        ShmKVTransferInfo info = ShmKVTransferInfo::decode(seq.kv_transfer_info);
        info.uid = static_cast<std::uint32_t>(::geteuid());  // pretend it is ours
        Reader r(a.layout, seq);
        try {
          r.manager.sync_retrieve(0, seq.num_tokens, r.pages, seq.page_indices, info.encode());
          say("CODE Ok read");
        } catch (const Error& e) {
          std::string msg = e.status().message();
          for (char& c : msg) {
            if (c == '\n') c = ' ';
          }
          say("CODE " + std::string(to_string(e.code())) + " " + msg);
        }
      } else if (line.rfind("pullloop ", 0) == 0) {
        const SequenceInfo seq = decode_hex(line.substr(9));
        Reader r(a.layout, seq);
        for (bool first = true;; first = false) {
          r.manager.sync_retrieve(0, seq.num_tokens, r.pages, seq.page_indices,
                                  seq.kv_transfer_info);
          if (first) {
            if (!verify_pattern(*r.cache, a.seed, r.pages, 0, seq.num_tokens).ok()) {
              throw Error(StatusCode::kInternal, "pulled bytes do not verify");
            }
            say("LOOPING");
          }
        }
      }
    }
    return 0;
  });
}
