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
  fuzz::require_transfer_info(*info);
  fuzz::require(info->encode() == bytes, "decode(bytes).encode() != bytes");
  fuzz::require(KVTransferInfo::decode(info->encode()) == *info, "round trip changed the value");
  return 0;
}
