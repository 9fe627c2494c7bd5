// Copyright mstar-kv authors.
//
// The engine cases of the multi-process suites: every engine of the engine
// table (factory.hpp), each way it runs between two processes of this host
// (its loopback setups), plus the fault wrapper around shm; each with why it
// cannot run here, if it cannot: not built, Mooncake without
// MSTAR_KV_MOONCAKE_LIB, CUDA IPC without a device (the CUDA error; with
// MSTAR_KV_REQUIRE_GPU=1 it runs, and fails without one).
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "mstar/kv/factory.hpp"

namespace mstar::kv::testing {

struct EngineCase {
  std::string label;  // the gtest parameter name: "shm", "ucx_tcp", "fault_shm"
  EngineTraits traits;
  std::map<std::string, std::string> env;    // for both processes
  std::map<std::string, std::string> extra;  // EngineOptions.extra
  std::string skip_reason;                   // non-empty: cannot run here
  // The reader's engine wrapped in a FaultInjectingEngine injecting nothing
  // (fault_injection.hpp): the wrapper must keep every engine invariant.
  bool fault_wrapper = false;
  // The loopback setup (its caches: the owner's memory, one region per
  // layer; make_loopback_cache).
  LoopbackSetup setup;
};
inline void PrintTo(const EngineCase& c, std::ostream* os) { *os << c.label; }

// Why Mooncake cannot run here ("" when it can): MSTAR_KV_MOONCAKE_LIB unset,
// not loadable, or without Mooncake's C API.
std::string mooncake_skip_reason();

// Every engine in engine_table() order, one case per loopback setup.
std::vector<EngineCase> engine_cases();
// The cases that need nothing beyond the build and a peer process (engines
// that cross processes and are self-contained, no fault wrapper);
// `one_setup_each`: only each engine's first loopback setup.
std::vector<EngineCase> self_contained_cases(bool one_setup_each = false);

}  // namespace mstar::kv::testing
