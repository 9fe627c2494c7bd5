// Copyright mstar-kv authors.
//
// A reader that goes away badly, as its own process (owner_survival_test.cpp):
// it pulls the sequence "--seq <hex SequenceInfo>" eight times at once into
// its cache (keeping only four of the futures), prints "STARTED" once bytes
// land (or after 5 s), then, by "--do":
//   kill     waits to be SIGKILLed (mid-read)
//   stall    waits to be SIGSTOPped and kept stopped: it never takes its
//            replies
//   cleanup  calls cleanup() with the reads in flight, prints "DONE", exits
//   destroy  destroys its manager with the reads in flight, prints "DONE"
//   vanish   does not wait for bytes: _exit(0) right after starting the
//            reads (connected, then gone without closing anything)
// Takes the peer arguments (tests/common/peer.hpp): --engine, --layout,
// --extra.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/peer.hpp"
#include "mstar/kv/kv.hpp"
#include "toolkit/seq_line.hpp"

using namespace mstar::kv;

int main(int argc, char** argv) {
  return testing::run_peer([&] {
    const testing::PeerArgs a = testing::parse_peer_args(argc, argv);
    const std::string what = a.other.at("--do");
    const auto seq = toolkit::parse_seq_line("SEQ " + a.other.at("--seq"));
    if (!seq) throw std::runtime_error("--seq is no sequence");
    auto cache = make_kv_cache(a.layout, MemoryKind::kHost);
    std::memset(cache->base(), 0xA5, cache->size_bytes());
    EngineOptions o = a.options;
    o.timeout = std::chrono::seconds(20);
    auto m = std::make_unique<KVTransferManager>(
        TransferEngineInfo{"doomed-reader", "", a.engine, o}, cache);
    std::vector<std::uint32_t> lp(seq->page_indices.size());
    for (std::uint32_t i = 0; i < lp.size(); ++i) lp[i] = i;
    std::vector<TransferFuture> kept;
    for (int i = 0; i < 8; ++i) {
      auto f =
          m->start_async_retrieve(0, seq->num_tokens, lp, seq->page_indices, seq->kv_transfer_info);
      if (f && i % 2 == 0) kept.push_back(*f);
    }
    if (what == "vanish") ::_exit(0);
    // Bytes landed: the owner is sending (one byte in 4096 looked at, with
    // relaxed atomic loads: the engine writes the cache meanwhile).
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    const auto* p = reinterpret_cast<const unsigned char*>(cache->base());
    bool landed = false;
    while (!landed && std::chrono::steady_clock::now() < end) {
      for (std::size_t i = 0; i < cache->size_bytes() && !landed; i += 4096)
        landed = __atomic_load_n(p + i, __ATOMIC_RELAXED) != 0xA5;
      if (!landed) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    testing::say(landed ? "STARTED" : "STARTED (no byte landed yet)");
    if (what == "kill" || what == "stall") {
      for (;;) ::pause();
    }
    if (what == "cleanup") {
      m->cleanup();
    } else if (what == "destroy") {
      m.reset();
    } else {
      throw std::runtime_error("--do " + what + " is not kill, stall, cleanup, destroy or vanish");
    }
    testing::say("DONE");
    return 0;
  });
}
