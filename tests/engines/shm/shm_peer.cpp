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
//   in  "refill <seed>"  (owner) rewrite the published pages with that
//                      seed's pattern; prints "REFILLED"
//   in  "quit"         exit 0 (also on EOF)
// --as-uid N drops to that uid and gid first (needs root); --extra K=V
// goes to the owner's engine options; --unaligned starts each private
// region 1 KiB into a page (a tensor's allocation: partial first and last
// pages).
// Errors print "ERR <message>" and exit 1.
#include <grp.h>
#include <sys/mman.h>
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
  std::vector<std::uint32_t> pages;
};

enum class OwnerMemory { kShared, kPrivate, kLayers };

// Private memory `kOffset` bytes into its own mapping, as a tensor's
// allocation is (glibc's chunk header first): its first and last pages are
// partial.
class OffsetMemory final : public KVMemory {
 public:
  static constexpr std::size_t kOffset = 1024;
  explicit OffsetMemory(std::size_t size) : size_(size), bytes_(size + kOffset + 4096) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of the owner's cache failed");
    base_ = static_cast<std::byte*>(p);
  }
  ~OffsetMemory() override { ::munmap(base_, bytes_); }
  std::byte* data() const noexcept override { return base_ + kOffset; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kHost; }

 private:
  std::size_t size_;
  std::size_t bytes_;
  std::byte* base_ = nullptr;
};

std::shared_ptr<KVCache> owner_cache(const KVLayout& l, OwnerMemory memory, bool unaligned) {
  if (unaligned && memory == OwnerMemory::kPrivate) {
    return std::make_shared<KVCache>(l, std::make_unique<OffsetMemory>(l.total_bytes()));
  }
  if (unaligned && memory == OwnerMemory::kLayers) {
    std::vector<std::unique_ptr<KVMemory>> layers;
    for (std::uint32_t i = 0; i < l.num_layers; ++i) {
      layers.push_back(std::make_unique<OffsetMemory>(l.layer_bytes()));
    }
    return std::make_shared<KVCache>(l, std::move(layers));
  }
  switch (memory) {
    case OwnerMemory::kPrivate:
      return make_kv_cache(l, MemoryKind::kHost);
    case OwnerMemory::kLayers:
      return KVCache::create_host_layers(l);
    default:
      return make_kv_cache(l, MemoryKind::kSharedHost);
  }
}

std::unique_ptr<Owner> make_owner(const testing::PeerArgs& a, OwnerMemory memory,
                                  std::shared_ptr<KVCache> cache = nullptr) {
  auto o = std::make_unique<Owner>();
  o->cache =
      cache ? std::move(cache) : owner_cache(a.layout, memory, a.flags.count("--unaligned") != 0);
  o->manager = std::make_unique<KVTransferManager>(TransferEngineInfo{"peer", "", "shm", a.options},
                                                   o->cache);
  o->pool = std::make_unique<KVCachePool>(o->cache, o->manager->get_kv_transfer_info(), a.scatter);
  o->pages = o->pool->allocate(1, a.tokens);
  fill_pattern(*o->cache, a.seed, o->pages, 0, a.tokens);
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
        testing::parse_peer_args(argc, argv, {"--reader", "--private", "--layers", "--unaligned"});
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
      owner = make_owner(a, memory);
    }
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line == "regen" && owner) {
        owner.reset();  // the old memfd is closed and unmapped here
        owner = make_owner(a, memory);
      } else if (line == "reengine" && owner) {
        std::shared_ptr<KVCache> cache = owner->cache;
        owner.reset();  // the engine goes (with its anchor), the cache stays
        owner = make_owner(a, memory, std::move(cache));
      } else if (line.rfind("refill ", 0) == 0 && owner) {
        fill_pattern(*owner->cache, std::stoull(line.substr(7)), owner->pages, 0, a.tokens);
        say("REFILLED");
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
