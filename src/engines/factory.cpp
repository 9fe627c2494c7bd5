// Copyright mstar-kv authors.
//
// The one place engines are created, and the table of what each can do
// (factory.hpp). MSTAR_KV_HAVE_<ENGINE> is defined (privately, by CMake) for
// each engine target that is built; this file is the only one that looks at
// those definitions.
#include "mstar/kv/factory.hpp"

#include <string>

#include "engine_makers.hpp"
#if MSTAR_KV_HAVE_SHM
#include "mstar/kv/shm.hpp"
#endif
#if MSTAR_KV_HAVE_MOONCAKE
#include "mstar/kv/mooncake.hpp"
#endif
#if MSTAR_KV_HAVE_CUDA_IPC
#include "mstar/kv/cuda_ipc.hpp"
#endif
#include "mstar/kv/local_only.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/stats.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace {

using Maker = std::unique_ptr<KVTransferEngine> (*)(std::shared_ptr<KVCache>,
                                                    const TransferEngineInfo&);
struct Entry {
  EngineTraits traits;
  Maker make;  // null when the engine is not built (and for local)
};

// Every engine, in a fixed order. Adding an engine: its folder, one row here.
std::vector<Entry> entries() {
  std::vector<Entry> t;
  {
    EngineTraits e;
    e.name = "local";
    e.crosses_processes = false;
    e.loopback = {{"local", {}, false}};
    t.push_back({e, nullptr});
  }
  {
    EngineTraits e;
    e.name = "shm";
    e.memory = MemoryKind::kSharedHost;
    e.host_readable = true;
    e.layer_readiness = true;
    e.loopback = {{"shm", {}, false}};
#if MSTAR_KV_HAVE_SHM
    t.push_back({e, &engines::make<ShmKVTransferEngine>});
#else
    t.push_back({e, nullptr});
#endif
  }
  {
    EngineTraits e;
    e.name = "ucx";
    e.crosses_hosts = true;
    e.layer_readiness = true;  // readiness notices from the owner (ucx_wire.hpp)
    e.loopback = {{"ucx-tcp", {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}}, true},
                  {"ucx-sm", {{"UCX_TLS", "sm,tcp"}, {"UCX_NET_DEVICES", "lo"}}, false}};
#if MSTAR_KV_HAVE_UCX
    t.push_back({e, &engines::make_ucx_engine});
#else
    t.push_back({e, nullptr});
#endif
  }
  {
    EngineTraits e;
    e.name = "mooncake";
    e.crosses_hosts = true;
    e.self_contained = false;
    e.library_option = "mooncake_lib";
    e.layer_readiness = true;  // bounded polls of the owner's words (mooncake_readiness.hpp)
    // Mooncake's INFO lines would bury a benchmark's table.
    e.loopback = {{"mooncake", {{"GLOG_minloglevel", "1"}}, true}};
#if MSTAR_KV_HAVE_MOONCAKE
    t.push_back({e, &engines::make<MooncakeKVTransferEngine>});
#else
    t.push_back({e, nullptr});
#endif
  }
  {
    EngineTraits e;
    e.name = "cuda_ipc";
    e.memory = MemoryKind::kDevice;
    e.reader_memory = MemoryKind::kDevice;
    e.self_contained = false;  // needs a CUDA device
    e.layer_readiness = true;  // the owner's host tables (cuda_ipc.hpp)
    e.loopback = {{"cuda_ipc", {}, false}};
#if MSTAR_KV_HAVE_CUDA_IPC
    t.push_back({e, &engines::make<CudaIpcKVTransferEngine>});
#else
    t.push_back({e, nullptr});
#endif
  }
  for (Entry& x : t) x.traits.built = !x.traits.crosses_processes || x.make != nullptr;
  return t;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

[[noreturn]] void throw_unknown(const std::string& name) {
  std::vector<std::string> known;
  for (const Entry& e : entries()) known.push_back(e.traits.name);
  throw Error(StatusCode::kInvalidArgument,
              "unknown transfer engine '" + name + "' (known: " + joined(known) + ")");
}

}  // namespace

std::vector<EngineTraits> engine_table() {
  std::vector<EngineTraits> out;
  for (Entry& e : entries()) out.push_back(std::move(e.traits));
  return out;
}

std::optional<EngineTraits> find_engine(const std::string& name) {
  const std::string n = name.empty() ? "local" : name;
  for (Entry& e : entries()) {
    if (e.traits.name == n) return std::move(e.traits);
  }
  return std::nullopt;
}

EngineTraits engine_traits(const std::string& name) {
  if (auto t = find_engine(name)) return *t;
  throw_unknown(name);
}

std::unique_ptr<KVTransferEngine> make_engine(
    const std::optional<TransferEngineInfo>& info,
    std::shared_ptr<KVCache> kv_cache) {
  if (!kv_cache) throw Error(StatusCode::kInvalidArgument, "make_engine needs a KV cache");
  if (!info || info->transfer_engine.empty() || info->transfer_engine == "local") {
    return std::make_unique<LocalOnlyKVTransferEngine>();
  }
  for (Entry& e : entries()) {
    if (info->transfer_engine != e.traits.name) continue;
    if (e.make == nullptr) {
      throw Error(StatusCode::kUnavailable, "transfer engine '" + info->transfer_engine +
                                                "' is not built into this mstar-kv (built: " +
                                                joined(built_engines()) + ")");
    }
    return e.make(std::move(kv_cache), *info);
  }
  throw_unknown(info->transfer_engine);
}

std::shared_ptr<KVCache> make_kv_cache(const KVLayout& layout, MemoryKind kind,
                                       int device) {
  layout.validate();
  switch (kind) {
    case MemoryKind::kHost:
      return KVCache::create_host(layout);
    case MemoryKind::kSharedHost:
#if MSTAR_KV_HAVE_SHM
      return std::make_shared<KVCache>(
          layout, engines::allocate_shared_memory(layout.total_bytes(), layout.num_pages));
#else
      throw Error(StatusCode::kUnavailable,
                  "shared host memory needs the shm engine, which is not built");
#endif
    case MemoryKind::kDevice:
#if MSTAR_KV_HAVE_CUDA_IPC
      return std::make_shared<KVCache>(
          layout, engines::allocate_device_memory(layout.total_bytes(), device));
#else
      (void)device;
      throw Error(StatusCode::kUnavailable,
                  "device memory needs the cuda_ipc engine, which is not built");
#endif
  }
  throw Error(StatusCode::kInvalidArgument,
              "unknown memory kind " + std::to_string(static_cast<int>(kind)));
}

std::vector<std::string> built_engines() {
  std::vector<std::string> out;
  for (const Entry& e : entries()) {
    if (e.traits.built) out.push_back(e.traits.name);
  }
  return out;
}

// The manager's engine-making constructor lives here, beside the factory,
// so that the core (src/core, mstar_kv_core) links without any engine.
KVTransferManager::KVTransferManager(
    std::optional<TransferEngineInfo> transfer_engine_info,
    std::shared_ptr<KVCache> kv_cache)
    : kv_cache_(std::move(kv_cache)) {
  if (!kv_cache_) {
    throw Error(StatusCode::kInvalidArgument, "KVTransferManager needs a KV cache");
  }
  engine_ = make_engine(transfer_engine_info, kv_cache_);
  if (transfer_engine_info) engine_timeout_ = transfer_engine_info->options.timeout;
  stats_ = std::make_shared<TransferStatsRecorder>(
      transfer_engine_info && !transfer_engine_info->transfer_engine.empty()
          ? transfer_engine_info->transfer_engine
          : "local");
}

}  // namespace mstar::kv
