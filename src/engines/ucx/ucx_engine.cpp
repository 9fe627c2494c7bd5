// Copyright mstar-kv authors.
//
// make_ucx_engine (for the factory) and the public UcxKVTransferInfo.
#include <memory>

#include "engine_makers.hpp"
#include "mstar/kv/ucx.hpp"
#include "rma/rma_engine.hpp"
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
  if (info.engine != "ucx") {
    throw Error(StatusCode::kInvalidArgument,
                "descriptor of engine '" + info.engine + "' is not a ucx descriptor");
  }
  const rma::RmaRegionInfo r = rma::RmaRegionInfo::decode(info.payload);
  UcxKVTransferInfo u;
  u.entity_id = r.entity_id;
  u.session_id = r.session_id;
  u.data_ptr = r.data_ptr;
  u.size = r.size;
  u.layout = r.layout;
  u.generation = r.generation;
  u.rkey = r.backend_blob;
  return u;
}

KVTransferInfo UcxKVTransferInfo::encode() const {
  rma::RmaRegionInfo r;
  r.entity_id = entity_id;
  r.session_id = session_id;
  r.data_ptr = data_ptr;
  r.size = size;
  r.layout = layout;
  r.generation = generation;
  r.backend_blob = rkey;
  return KVTransferInfo{"ucx", r.encode()};
}

}  // namespace mstar::kv
