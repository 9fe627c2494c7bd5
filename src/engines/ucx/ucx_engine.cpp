// Copyright mstar-kv authors.
//
// The ucx engine's hooks for the factory (an RMA engine over the UCX
// backend: it has no public class) and the public UcxKVTransferInfo.
#include <memory>

#include "engines/engine_makers.hpp"
#include "mstar/kv/engines/ucx.hpp"
#include "rma/rma_engine.hpp"
#include "ucx_backend.hpp"

namespace mstar::kv {

namespace engines {

EngineHooks hooks_ucx() {
  EngineHooks h;
  h.make = [](std::shared_ptr<KVCache> cache,
              const TransferEngineInfo& info) -> std::unique_ptr<KVTransferEngine> {
    const ucx::UcxOptions options = ucx::UcxOptions::parse(info.options);
    auto backend =
        std::make_unique<ucx::UcxBackend>(cache, info.my_entity_id, info.my_session_id, options);
    return std::make_unique<rma::RmaKVTransferEngine>(std::move(cache), std::move(backend),
                                                      info.options);
  };
  return h;
}

}  // namespace engines

UcxKVTransferInfo UcxKVTransferInfo::decode(const KVTransferInfo& info) {
  UcxKVTransferInfo u;
  u.rkey = rma::decode_region(info, "ucx", "ucx", u);
  return u;
}

KVTransferInfo UcxKVTransferInfo::encode() const {
  return KVTransferInfo{"ucx", rma::region_of(*this, rkey).encode()};
}

}  // namespace mstar::kv
