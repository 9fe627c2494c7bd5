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
  fuzz::require_transfer_info(s->kv_transfer_info);
  fuzz::require(s->encode() == bytes, "decode(bytes).encode() != bytes");
  fuzz::require(SequenceInfo::decode(s->encode()) == *s, "round trip changed the value");
  return 0;
}
