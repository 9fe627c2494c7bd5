// Copyright mstar-kv authors.
//
// The serving side of the shared-handle tests, as its own process: an
// "application" that runs Mooncake itself (AppMooncake: createTransferEngine
// + installTransport through the C API in MSTAR_KV_MOONCAKE_LIB) and gives
// its handle to a MooncakeKVTransferEngine. Fills sequence 1 with the
// pattern and prints "SEQ <hex SequenceInfo>". Then, one command a line:
//   restart  shuts the engine down and makes a new one on the same handle
//            and cache (which only works if the first one unregistered the
//            cache), prints the new "SEQ <hex>";
//   quit     (or end of input) shuts the engine down, then destroys the
//            application's handle.
// Failures print "ERR <message>" and exit 1.
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "common/peer.hpp"
#include "engines/mooncake/mooncake_test_util.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

using namespace mstar::kv;

int main(int argc, char** argv) {
  return testing::run_peer([&] {
    const testing::PeerArgs a = testing::parse_peer_args(argc, argv);
    const char* lib = std::getenv("MSTAR_KV_MOONCAKE_LIB");
    if (lib == nullptr) throw std::runtime_error("MSTAR_KV_MOONCAKE_LIB is not set");
    testing::AppMooncake app(lib);
    auto cache = make_kv_cache(a.layout, MemoryKind::kHost);
    std::unique_ptr<MooncakeKVTransferEngine> engine;
    auto start = [&] {
      engine = std::make_unique<MooncakeKVTransferEngine>(cache, "peer", app.handle(), a.options);
      if (engine->session_id() != app.ip_port()) {
        throw std::runtime_error("session id " + engine->session_id() + " is not the handle's " +
                                 app.ip_port());
      }
      KVCachePool pool(cache, engine->get_kv_transfer_info(), a.scatter);
      auto pages = pool.allocate(1, a.tokens);
      fill_pattern(*cache, a.seed, pages, 0, a.tokens);
      testing::say_sequence(pool.publish(1));
    };
    start();
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
      if (line == "restart") {
        engine->shutdown();
        engine.reset();
        start();
      }
    }
    engine->shutdown();
    engine.reset();
    // ~AppMooncake: the application destroys its own engine, after ours.
    return 0;
  });
}
