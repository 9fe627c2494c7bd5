// Copyright mstar-kv authors.
#include "common/peer_process.hpp"

#ifndef KV_CONFORMANCE_PEER_PATH
#error "KV_CONFORMANCE_PEER_PATH must name the peer executable"
#endif

namespace mstar::kv::testing {

namespace {

std::vector<std::string> peer_args(const PeerSpec& spec) {
  std::vector<std::string> args = {KV_CONFORMANCE_PEER_PATH,
                                   "--engine",
                                   spec.engine,
                                   "--layout",
                                   layout_arg(spec.layout),
                                   "--tokens",
                                   std::to_string(spec.tokens),
                                   "--seed",
                                   std::to_string(spec.seed),
                                   "--scatter",
                                   std::to_string(spec.scatter_seed)};
  if (spec.lease_ms >= 0) {
    args.push_back("--lease-ms");
    args.push_back(std::to_string(spec.lease_ms));
  }
  if (spec.setup.owner_memory) {
    args.push_back("--owner-memory");
    args.push_back(std::to_string(static_cast<int>(*spec.setup.owner_memory)));
  }
  if (spec.setup.layer_regions) {
    args.push_back("--layer-regions");
    args.push_back("1");
  }
  for (const auto& [k, v] : spec.extra) {
    args.push_back("--extra");
    args.push_back(k + "=" + v);
  }
  return args;
}

}  // namespace

PeerProcess::PeerProcess(const PeerSpec& spec, std::chrono::milliseconds timeout)
    : Peer(peer_args(spec), spec.env, timeout) {}

}  // namespace mstar::kv::testing
