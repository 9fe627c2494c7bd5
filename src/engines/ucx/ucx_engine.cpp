// Copyright mstar-kv authors.
//
// make_ucx_engine (for the factory) and the public UcxKVTransferInfo.
#include <memory>

#include "engines/engine_makers.hpp"
#include "mstar/kv/ucx.hpp"
#include "engines/rma/rma_engine.hpp"
#include "ucx_backend.hpp"

namespace mstar::kv {

namespace engines {

std::unique_ptr<KVTransferEngine> make_ucx_engine(std::shared_ptr<KVCache> cache,
                                                  const TransferEngineInfo& info) {
  const ucx::UcxOptions options = ucx::UcxOptions::parse(info.options);
  auto backend = std::make_unique<ucx::UcxBackend>(cache, info.my_entity_id,
                                                   info.my_session_id, options);
  return std::make_unique<rma::RmaKVTransferEngine>(std::move(cache), std::move(backend),
                                                    info.options);
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
