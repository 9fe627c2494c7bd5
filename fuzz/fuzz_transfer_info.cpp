// Copyright mstar-kv authors.
//
// KVTransferInfo::decode on untrusted bytes: it either throws Error or
// returns a value that encodes back to exactly the same bytes.
#include <cstdint>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const std::vector<std::uint8_t> bytes = fuzz::frame_input(data, size);
  const auto info = fuzz::decoded([&] { return KVTransferInfo::decode(bytes); });
  if (!info) return 0;
  fuzz::require(info->engine.size() <= DescriptorLimits::kMaxEngineName, "engine name limit");
  fuzz::require(info->payload.size() <= DescriptorLimits::kMaxTransferPayload, "payload limit");
  fuzz::require(!info->empty() || info->epoch == 0, "local-only descriptor with an epoch");
  // page_epochs: ascending pages named once, each epoch neither 0 nor the
  // descriptor's own, on a descriptor with an epoch.
  const auto& pe = (*info).page_epochs;
  for (std::size_t i = 0; i < pe.size(); ++i) {
    fuzz::require(pe[i].epoch != 0 && pe[i].epoch != (*info).epoch, "page_epochs epoch");
    fuzz::require(i == 0 || pe[i - 1].page < pe[i].page, "page_epochs order");
  }
  fuzz::require(pe.empty() || (*info).epoch != 0, "page_epochs without an epoch");
  fuzz::require(info->encode() == bytes, "decode(bytes).encode() != bytes");
  fuzz::require(KVTransferInfo::decode(info->encode()) == *info, "round trip changed the value");
  return 0;
}
