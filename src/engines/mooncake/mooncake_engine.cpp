// Copyright mstar-kv authors.
//
// MooncakeKVTransferEngine: the RMA engine over MooncakeBackend, plus its
// options and descriptor (include/mstar/kv/engines/mooncake.hpp).
#include <string>
#include <utility>

#include "engines/engine_makers.hpp"
#include "mooncake_api.hpp"
#include "mooncake_backend.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "rma/rma_engine.hpp"
#include "util/parse.hpp"

namespace mstar::kv {

MooncakeOptions MooncakeOptions::parse(const EngineOptions& options, bool shared_handle) {
  const std::map<std::string, std::string>& extra = options.extra;
  MooncakeOptions o;
  o.library_path = mooncake::resolve_library_path(extra);
  for (const auto& [key, value] : extra) {
    if (key.rfind("mooncake_", 0) != 0) continue;  // another engine's option
    if (shared_handle &&
        (key == "mooncake_metadata" || key == "mooncake_host" || key == "mooncake_protocol")) {
      throw Error(StatusCode::kInvalidArgument,
                  "Mooncake option '" + key + "' = '" + value +
                      "' configures an engine this one creates; with a shared Mooncake "
                      "engine handle the application chose it in createTransferEngine / "
                      "installTransport");
    }
    if (key == "mooncake_session_id") {
      if (!shared_handle) {
        throw Error(StatusCode::kInvalidArgument,
                    "Mooncake option 'mooncake_session_id' = '" + value +
                        "' applies to a shared Mooncake engine handle only; set "
                        "TransferEngineInfo::my_session_id instead");
      }
      o.session_id = value;
    } else if (key == "mooncake_lib") {
      // resolved above
    } else if (key == "mooncake_metadata") {
      o.metadata = value;
    } else if (key == "mooncake_host") {
      o.host = value;
    } else if (key == "mooncake_protocol") {
      o.protocol = value;
    } else if (key == "mooncake_location") {
      o.location = value;
    } else if (key == "mooncake_abort_grace_ms") {
      o.abort_grace_ms = static_cast<std::uint32_t>(
          util::parse_u64(value, "mooncake_abort_grace_ms (milliseconds)", 1, 600000));
    } else {
      throw Error(StatusCode::kInvalidArgument,
                  "unknown Mooncake option '" + key +
                      "' (known: mooncake_lib, mooncake_metadata, mooncake_host, "
                      "mooncake_protocol, mooncake_location, mooncake_abort_grace_ms, "
                      "mooncake_session_id)");
    }
  }
  if (o.metadata.empty() || o.protocol.empty() || o.location.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "mooncake_metadata, mooncake_protocol and mooncake_location must not be empty");
  }
  return o;
}

KVTransferInfo MooncakeKVTransferInfo::encode() const {
  return KVTransferInfo{
      kEngineName,
      rma::region_of(*this, mooncake::encode_blob({identity_ptr, epochs_ptr, ready_ptr})).encode()};
}

MooncakeKVTransferInfo MooncakeKVTransferInfo::decode(const KVTransferInfo& info) {
  MooncakeKVTransferInfo out;
  const auto blob = mooncake::decode_blob(rma::decode_region(info, kEngineName, "Mooncake", out));
  out.identity_ptr = blob.identity_ptr;
  out.epochs_ptr = blob.epochs_ptr;
  out.ready_ptr = blob.ready_ptr;
  if (out.epochs_ptr + std::uint64_t{out.layout.num_pages} * 8 < out.epochs_ptr) {
    throw Error(StatusCode::kCorruptDescriptor, "Mooncake descriptor: epochs_ptr + 8 x " +
                                                    std::to_string(out.layout.num_pages) +
                                                    " pages overflows");
  }
  if (out.ready_ptr + std::uint64_t{out.layout.num_pages} * 4 < out.ready_ptr) {
    throw Error(StatusCode::kCorruptDescriptor, "Mooncake descriptor: ready_ptr + 4 x " +
                                                    std::to_string(out.layout.num_pages) +
                                                    " pages overflows");
  }
  return out;
}

namespace {

void check_cache(const std::shared_ptr<KVCache>& kv_cache) {
  if (!kv_cache) {
    throw Error(StatusCode::kInvalidArgument, "MooncakeKVTransferEngine needs a KV cache");
  }
  if (kv_cache->memory_kind() == MemoryKind::kDevice) {
    throw Error(StatusCode::kInvalidArgument,
                "the Mooncake engine reads host memory; this cache is device memory "
                "(use kHost or kSharedHost)");
  }
  if (kv_cache->split()) {
    throw Error(StatusCode::kNotSupported,
                "the C++ Mooncake engine (over Mooncake's C library) registers and reads caches "
                "of one region; this cache has " +
                    std::to_string(kv_cache->num_regions()) +
                    " (one per layer): use the wheel engine "
                    "(mstar_kv.MooncakeKVTransferEngine over a mooncake.engine.TransferEngine), "
                    "which registers each region, or a cache of one region");
  }
}

// mooncake.hpp ("Authentication"): Mooncake's transports cannot check a token.
void warn_unauthenticated(const EngineOptions& options) {
  if (options.extra.count("auth_token") == 0) return;
  options.log.warn(
      "mooncake: auth_token authenticates nothing on Mooncake's data path (its transports "
      "serve registered memory to any peer that opens the segment); it protects only the "
      "control plane. Use the ucx engine for authenticated reads");
}

}  // namespace

MooncakeKVTransferEngine::MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                                   const TransferEngineInfo& info) {
  check_cache(kv_cache);
  warn_unauthenticated(info.options);
  MooncakeOptions options = MooncakeOptions::parse(info.options);
  options.log = info.options.log;
  auto backend = std::make_unique<mooncake::MooncakeBackend>(kv_cache, options, info.my_entity_id,
                                                             info.my_session_id);
  session_id_ = backend->session_id();
  impl_ = std::make_unique<rma::RmaKVTransferEngine>(std::move(kv_cache), std::move(backend),
                                                     info.options);
}

MooncakeKVTransferEngine::MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                                   std::string entity_id,
                                                   MooncakeEngineHandle transfer_engine,
                                                   const EngineOptions& options) {
  if (transfer_engine == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "MooncakeKVTransferEngine: transfer_engine is null (0x0); pass the live "
                "transfer_engine_t that Mooncake's createTransferEngine returned (with "
                "installTransport done), or use the constructor taking a "
                "TransferEngineInfo to let the engine create its own");
  }
  check_cache(kv_cache);
  warn_unauthenticated(options);
  MooncakeOptions mo = MooncakeOptions::parse(options, /*shared_handle=*/true);
  mo.log = options.log;
  auto backend = std::make_unique<mooncake::MooncakeBackend>(kv_cache, mo, entity_id, mo.session_id,
                                                             transfer_engine);
  session_id_ = backend->session_id();
  impl_ =
      std::make_unique<rma::RmaKVTransferEngine>(std::move(kv_cache), std::move(backend), options);
}

MooncakeKVTransferEngine::~MooncakeKVTransferEngine() = default;

KVTransferInfo MooncakeKVTransferEngine::get_kv_transfer_info() const {
  return impl_->get_kv_transfer_info();
}

RemoteHandle MooncakeKVTransferEngine::open_remote(const KVTransferInfo& remote) const {
  return impl_->open_remote(remote);
}

std::optional<TransferFuture> MooncakeKVTransferEngine::read_batched_async(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  return impl_->read_batched_async(remote, read_info);
}

std::unique_ptr<LayerWatch> MooncakeKVTransferEngine::watch_layers(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  return impl_->watch_layers(remote, read_info);
}

void MooncakeKVTransferEngine::connect(const RemoteCache& remote) { impl_->connect(remote); }

void MooncakeKVTransferEngine::shutdown() { impl_->shutdown(); }

namespace engines {

EngineHooks hooks_mooncake() {
  EngineHooks h;
  h.make = &make<MooncakeKVTransferEngine>;
  return h;
}

}  // namespace engines

}  // namespace mstar::kv
