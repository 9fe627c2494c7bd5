// Copyright mstar-kv authors.
//
// The one place engines are created. MSTAR_KV_HAVE_<ENGINE> is defined
// (privately, by CMake) for each engine target that is built; this file is
// the only one that looks at those definitions.
#include <string>

#include "engine_makers.hpp"
#include "mstar/kv/local_only.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace {

using Maker = std::unique_ptr<KVTransferEngine> (*)(std::shared_ptr<KVCache>,
                                                    const TransferEngineInfo&);
struct Entry {
  const char* name;
  Maker make;  // null when the engine is not built
};

constexpr Entry kEngines[] = {
#if MSTAR_KV_HAVE_SHM
    {"shm", &engines::make_shm_engine},
#else
    {"shm", nullptr},
#endif
#if MSTAR_KV_HAVE_UCX
    {"ucx", &engines::make_ucx_engine},
#else
    {"ucx", nullptr},
#endif
#if MSTAR_KV_HAVE_MOONCAKE
    {"mooncake", &engines::make_mooncake_engine},
#else
    {"mooncake", nullptr},
#endif
#if MSTAR_KV_HAVE_CUDA_IPC
    {"cuda_ipc", &engines::make_cuda_ipc_engine},
#else
    {"cuda_ipc", nullptr},
#endif
};

}  // namespace

std::unique_ptr<KVTransferEngine> make_engine(
    const std::optional<TransferEngineInfo>& info,
    std::shared_ptr<KVCache> kv_cache) {
  if (!kv_cache) throw Error(StatusCode::kInvalidArgument, "make_engine needs a KV cache");
  if (!info || info->transfer_engine.empty() || info->transfer_engine == "local") {
    return std::make_unique<LocalOnlyKVTransferEngine>();
  }
  std::string known = "local";
  for (const Entry& e : kEngines) {
    if (info->transfer_engine == e.name) {
      if (e.make == nullptr) {
        throw Error(StatusCode::kUnavailable,
                    "transfer engine '" + info->transfer_engine +
                        "' is not built into this mstar-kv (built: " +
                        [] {
                          std::string s;
                          for (const auto& n : built_engines()) s += (s.empty() ? "" : ", ") + n;
                          return s;
                        }() + ")");
      }
      return e.make(std::move(kv_cache), *info);
    }
    known += std::string(", ") + e.name;
  }
  throw Error(StatusCode::kInvalidArgument,
              "unknown transfer engine '" + info->transfer_engine + "' (known: " +
                  known + ")");
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
  std::vector<std::string> out{"local"};
  for (const Entry& e : kEngines) {
    if (e.make != nullptr) out.emplace_back(e.name);
  }
  return out;
}

}  // namespace mstar::kv
