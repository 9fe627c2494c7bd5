// Copyright mstar-kv authors.
//
// SequenceInfo::decode on untrusted bytes: it either throws Error or returns
// a value that encodes back to exactly the same bytes.
#include <cstdint>

#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const std::vector<std::uint8_t> bytes = fuzz::frame_input(data, size);
  const auto s = fuzz::decoded([&] { return SequenceInfo::decode(bytes); });
  if (!s) return 0;
  fuzz::require(s->page_indices.size() <= DescriptorLimits::kMaxPagesPerSequence, "page limit");
  fuzz::require(s->kv_transfer_info.payload.size() <= DescriptorLimits::kMaxTransferPayload,
                "payload limit");
  // The page epoch and the lease are untrusted too: a local-only descriptor
  // never carries an epoch (nothing could check it).
  fuzz::require(!s->kv_transfer_info.empty() || s->kv_transfer_info.epoch == 0,
                "local-only descriptor with an epoch");
  // page_epochs: ascending pages named once, each epoch neither 0 nor the
  // descriptor's own, on a descriptor with an epoch.
  const auto& pe = s->kv_transfer_info.page_epochs;
  for (std::size_t i = 0; i < pe.size(); ++i) {
    fuzz::require(pe[i].epoch != 0 && pe[i].epoch != s->kv_transfer_info.epoch,
                  "page_epochs epoch");
    fuzz::require(i == 0 || pe[i - 1].page < pe[i].page, "page_epochs order");
  }
  fuzz::require(pe.empty() || s->kv_transfer_info.epoch != 0, "page_epochs without an epoch");
  fuzz::require(s->encode() == bytes, "decode(bytes).encode() != bytes");
  fuzz::require(SequenceInfo::decode(s->encode()) == *s, "round trip changed the value");
  return 0;
}
