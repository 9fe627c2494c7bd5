// Copyright mstar-kv authors.
#include "common/engine_cases.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "common/cache_probe.hpp"

namespace mstar::kv::testing {

namespace {

// Why `t`'s run-time needs are missing here ("" when they are not): the
// library it loads (Mooncake: MSTAR_KV_MOONCAKE_LIB) or a CUDA device.
std::string missing_runtime(const EngineTraits& t, const LoopbackSetup& setup,
                            std::map<std::string, std::string>& extra) {
  if (!t.library_option.empty()) {
    std::string why = mooncake_skip_reason();
    if (!why.empty()) return why;
    extra[t.library_option] = std::getenv("MSTAR_KV_MOONCAKE_LIB");
  }
  const bool device = setup.owner_memory.value_or(t.memory) == MemoryKind::kDevice ||
                      setup.reader_memory.value_or(t.reader_memory) == MemoryKind::kDevice;
  if (device) {
    const auto built = built_engines();
    if (std::find(built.begin(), built.end(), "cuda_ipc") == built.end()) {
      return "device caches need the cuda_ipc engine, which is not built";
    }
    // MSTAR_KV_REQUIRE_GPU=1 (scripts/gpu-check): run, and fail without one.
    if (!gpu_required()) return no_device_reason();
  }
  return "";
}

std::string label_of(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

}  // namespace

std::string mooncake_skip_reason() {
  const char* lib = std::getenv("MSTAR_KV_MOONCAKE_LIB");
  if (lib == nullptr || *lib == '\0') {
    return "MSTAR_KV_MOONCAKE_LIB is not set: no Mooncake library with the C API here (the "
           "PyPI wheel mooncake-transfer-engine-non-cuda carries none; build "
           "libtransfer_engine.so from Mooncake's source)";
  }
  void* h = ::dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return std::string("cannot load MSTAR_KV_MOONCAKE_LIB: ") + ::dlerror();
  const bool has = ::dlsym(h, "createTransferEngine") != nullptr;
  ::dlclose(h);
  return has ? "" : std::string("MSTAR_KV_MOONCAKE_LIB has no Mooncake C API: ") + lib;
}

std::vector<EngineCase> engine_cases() {
  std::vector<EngineCase> cases;
  for (const EngineTraits& t : engine_table()) {
    for (const LoopbackSetup& setup : t.loopback) {
      EngineCase c{label_of(setup.name), t, setup.env, {}, "", false, setup};
      if (!t.built) {
        c.skip_reason = "engine '" + t.name + "' is not built";
      } else {
        c.skip_reason = missing_runtime(t, setup, c.extra);
      }
      cases.push_back(c);
      if (t.name == "shm" && &setup == &t.loopback.front()) {
        // One wrapped engine: the wrapper is engine-agnostic.
        c.label = "fault_shm";
        c.fault_wrapper = true;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

std::vector<EngineCase> self_contained_cases(bool one_setup_each) {
  std::vector<EngineCase> out;
  std::set<std::string> seen;
  for (EngineCase& c : engine_cases()) {
    if (c.fault_wrapper || !c.traits.crosses_processes || !c.traits.self_contained) continue;
    if (one_setup_each && !seen.insert(c.traits.name).second) continue;
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace mstar::kv::testing
