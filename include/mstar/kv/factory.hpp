// Copyright mstar-kv authors.
//
// The engine table: every engine mstar-kv knows, what each can do (its
// traits, as data), and the one place engines and their caches are made.
// Tools choose memory kinds, baselines and cases from the traits instead of
// comparing engine names. An engine is its folder plus its row in the table
// (src/engines/factory.cpp); the build also lists engines in CMake
// (docs/architecture.md, "Adding an engine"). All functions are safe from any
// thread.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"

namespace mstar::kv {

// One way to run an engine between two processes of this host: its name
// ("ucx-tcp"), the environment both processes need, and whether its bytes
// cross a TCP socket (then TCP's own best, not memcpy, is the limit).
struct LoopbackSetup {
  std::string name;
  std::map<std::string, std::string> env;
  bool over_tcp = false;
  // The caches of this setup where they differ from the engine's traits:
  // the owner's memory (shm-cma: a private cache, which the shm engine
  // serves through cross-memory attach), and caches of one region per
  // layer on both sides (KVCache over per-layer memories, for layouts whose
  // layers are contiguous; a page-major cache stays one region).
  std::optional<MemoryKind> owner_memory;
  bool layer_regions = false;
  // The reader's cache memory where it differs from the engine's
  // (ucx-tcp-device: device caches on both sides, staged through host
  // buffers; it needs a CUDA device and the cuda_ipc engine's kernel).
  std::optional<MemoryKind> reader_memory;
};

struct EngineTraits {
  std::string name;    // the TransferEngineInfo::transfer_engine name
  bool built = false;  // compiled into this library
  // The memory the owner's cache lives in (make_kv_cache's kind for it) and
  // the memory a reader's cache lives in.
  MemoryKind memory = MemoryKind::kHost;
  MemoryKind reader_memory = MemoryKind::kHost;
  bool crosses_processes = true;  // false for local: nothing leaves the process
  // A reader on the same host can map the owner's cache and read it
  // directly (shm), e.g. for a memcpy baseline over the owner's memory.
  bool host_readable = false;
  bool crosses_hosts = false;    // its peers may be on other hosts
  bool layer_readiness = false;  // streams layer by layer (the owner marks layers)
  // Runs with nothing beyond its build: no device, no library loaded at run
  // time.
  bool self_contained = true;
  // The EngineOptions::extra key naming a library it loads at run time
  // ("mooncake_lib"); empty when it loads none.
  std::string library_option;
  // The ways to run it between two processes of one host; {name} at least.
  std::vector<LoopbackSetup> loopback;
};

// Every engine mstar-kv knows, built or not, in a fixed order (local first).
std::vector<EngineTraits> engine_table();
// The traits of `name` ("" is "local"); nullopt for a name that is no engine.
std::optional<EngineTraits> find_engine(const std::string& name);
// The traits of `name`; throws Error(kInvalidArgument) naming the known
// engines for a name that is no engine.
EngineTraits engine_traits(const std::string& name);

// The one place engines are created. With no info (or "local") the engine is
// LocalOnlyKVTransferEngine. Throws Error(kUnavailable) naming the engine
// when it is a known engine that was not built or cannot run here,
// Error(kInvalidArgument) for a name that is no engine at all (listing the
// known ones) and when the cache's memory kind does not suit it.
std::unique_ptr<KVTransferEngine> make_engine(const std::optional<TransferEngineInfo>& info,
                                              std::shared_ptr<KVCache> kv_cache);

// Engines compiled into this build, e.g. {"local", "shm", "ucx"}.
std::vector<std::string> built_engines();

// A zero-filled cache in memory of the given kind: kHost (private), kSharedHost
// (needs the shm engine; mappable by other processes of the same user) or
// kDevice (needs the cuda_ipc engine; on CUDA device `device`). Throws
// Error(kUnavailable) when the engine providing that memory is not built.
std::shared_ptr<KVCache> make_kv_cache(const KVLayout& layout, MemoryKind kind, int device = 0);

// The cache one side of a loopback setup runs with (tools, tests): the
// owner's (`owner`) or the reader's memory of `engine` as `setup` names it,
// in one region per layer (KVCache::create_host_layers) when the setup says
// so, the memory is private host memory and the layout's layers are
// contiguous; else make_kv_cache(layout, kind).
std::shared_ptr<KVCache> make_loopback_cache(const EngineTraits& engine, const LoopbackSetup& setup,
                                             const KVLayout& layout, bool owner);

}  // namespace mstar::kv
