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

#include "common/wire.hpp"
#include "engines/mooncake/mooncake_test_util.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/mooncake.hpp"

using namespace mstar::kv;

int main(int argc, char** argv) {
  std::string layout_s;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter = 0;
  EngineOptions options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--layout") layout_s = v;
    else if (k == "--tokens") tokens = std::stoull(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--scatter") scatter = std::stoull(v);
    else if (k == "--extra") {
      const auto eq = v.find('=');
      options.extra[v.substr(0, eq)] = v.substr(eq + 1);
    }
  }
  try {
    const char* lib = std::getenv("MSTAR_KV_MOONCAKE_LIB");
    if (lib == nullptr) throw std::runtime_error("MSTAR_KV_MOONCAKE_LIB is not set");
    testing::AppMooncake app(lib);
    const KVLayout layout = testing::parse_layout_arg(layout_s);
    auto cache = make_kv_cache(layout, MemoryKind::kHost);
    std::unique_ptr<MooncakeKVTransferEngine> engine;
    auto start = [&] {
      engine = std::make_unique<MooncakeKVTransferEngine>(cache, "peer", app.handle(), options);
      if (engine->session_id() != app.ip_port()) {
        throw std::runtime_error("session id " + engine->session_id() +
                                 " is not the handle's " + app.ip_port());
      }
      KVCachePool pool(cache, engine->get_kv_transfer_info(), scatter);
      auto pages = pool.allocate(1, tokens);
      fill_pattern(*cache, seed, pages, 0, tokens);
      std::cout << "SEQ " << testing::to_hex(pool.publish(1).encode()) << std::endl;
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
