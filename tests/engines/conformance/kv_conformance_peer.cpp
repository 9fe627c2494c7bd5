// Copyright mstar-kv authors.
//
// The serving side of the conformance suite, as its own process: builds a
// cache for the named engine (device memory for cuda_ipc, filled through a
// host copy), fills sequence 1 with the pattern, prints
// "SEQ <hex>" and keeps its engine alive until stdin says "quit" or closes.
// Page reuse (the page epoch tests): "next <delay_us>" waits that long,
// releases the current sequence, allocates the next id on the same pages
// (the free list is LIFO), fills them with seed + id and prints its "SEQ".
// "lease <ms>" before anything else is the pool's lease; "expire" reaps.
// Layer-wise streaming (a deliberately slow owner): "stream <ms> <n>"
// allocates sequence 1000, fills all its layers with the poison byte 0xEE,
// publishes it with 0 layers ready and prints its "SEQ"; then a thread, for
// each of the first n layers, sleeps <ms>, writes the layer's pattern, marks
// it ready and prints "MARKED <layer> <steady-clock ns of the mark>". "rawready <v>"
// stamps v on the stream's readiness words behind the pool's back (a broken
// owner); "reuse" releases the stream's sequence, allocates 1001 on the same
// pages, fills and publishes it (a new generation) and prints its "SEQ".
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

#include "common/cache_probe.hpp"
#include "common/peer.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

using namespace mstar::kv;
using testing::say;
using testing::say_sequence;

int main(int argc, char** argv) {
  return testing::run_peer([&] {
    const testing::PeerArgs a = testing::parse_peer_args(argc, argv);
    const KVLayout& layout = a.layout;
    const std::uint64_t tokens = a.tokens;
    const std::uint64_t seed = a.seed;
    // The loopback setup's cache (--owner-memory, --layer-regions).
    LoopbackSetup setup;
    if (auto it = a.other.find("--owner-memory"); it != a.other.end()) {
      setup.owner_memory = static_cast<MemoryKind>(std::stoi(it->second));
    }
    setup.layer_regions = a.other.count("--layer-regions") != 0;
    auto cache = make_loopback_cache(engine_traits(a.engine), setup, layout, /*owner=*/true);
    KVTransferManager manager(TransferEngineInfo{"peer", "", a.engine, a.options}, cache);
    auto pool_ptr = std::make_shared<KVCachePool>(cache, manager.get_kv_transfer_info(), a.scatter,
                                                  a.lease.value_or(KVCachePool::kDefaultLease));
    KVCachePool& pool = *pool_ptr;
    manager.serve_done_notices(pool_ptr);  // UCX readers may say "done"
    auto pages = pool.allocate(1, tokens);
    testing::fill_pattern_any(*cache, seed, pages, 0, tokens);
    say_sequence(pool.publish(1));
    std::uint64_t current = 1;
    std::thread marker;
    std::uint64_t stream_id = 0;
    std::vector<std::uint32_t> stream_pages;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line.rfind("stream ", 0) == 0) {
        const auto sp = line.find(' ', 7);
        const auto ms = std::chrono::milliseconds(std::stoll(line.substr(7, sp - 7)));
        const auto n = static_cast<std::uint32_t>(std::stoul(line.substr(sp + 1)));
        if (marker.joinable()) marker.join();
        stream_id = 1000;
        stream_pages = pool.allocate(stream_id, tokens);
        testing::fill_pages_any(*cache, stream_pages, std::byte{0xEE});
        say_sequence(pool.publish(stream_id, 0));
        marker = std::thread([&, ms, n, id = stream_id, pages = stream_pages] {
          for (std::uint32_t l = 0; l < n; ++l) {
            std::this_thread::sleep_for(ms);
            testing::fill_pattern_layers_any(*cache, seed, pages, 0, tokens, l, l + 1);
            // The time is taken before the mark: a reader may see the
            // layer (and finish it) before this thread runs again.
            const auto t = std::chrono::steady_clock::now().time_since_epoch();
            pool.mark_layers_ready(id, l + 1);
            say("MARKED " + std::to_string(l) + " " +
                std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(t).count()));
          }
        });
        continue;
      }
      if (line.rfind("rawready ", 0) == 0) {
        cache->readiness().stamp(stream_pages,
                                 static_cast<std::uint32_t>(std::stoul(line.substr(9))));
        say("RAW");
        continue;
      }
      if (line == "reuse") {
        if (marker.joinable()) marker.join();
        pool.release(stream_id);
        stream_id = 1001;
        stream_pages = pool.allocate(stream_id, tokens);
        testing::fill_pattern_any(*cache, seed, stream_pages, 0, tokens);
        say_sequence(pool.publish(stream_id));
        continue;
      }
      if (line.rfind("next ", 0) == 0) {
        const auto until = std::chrono::steady_clock::now() +
                           std::chrono::microseconds(std::stoull(line.substr(5)));
        while (std::chrono::steady_clock::now() < until) {
        }
        pool.release(current);
        ++current;
        pages = pool.allocate(current, tokens);
        testing::fill_pattern_any(*cache, seed + current, pages, 0, tokens);
        say_sequence(pool.publish(current));
      } else if (line == "contains") {
        say("CONTAINS " + std::to_string(pool.contains(current)));
      } else if (line == "expire") {
        say("EXPIRED " + std::to_string(pool.expire_leases()));
      }
    }
    if (marker.joinable()) marker.join();
    manager.cleanup();
    return 0;
  });
}
