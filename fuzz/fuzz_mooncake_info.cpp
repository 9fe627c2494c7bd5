// Copyright mstar-kv authors.
//
// The mooncake engine's descriptor decoder on an untrusted payload: it
// throws Error(kCorruptDescriptor) or returns a value that fits its layout
// and encodes back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/engines/mooncake.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info = fuzz::payload("mooncake", data, size);
  const auto m = fuzz::decoded([&] { return MooncakeKVTransferInfo::decode(info); });
  if (m) fuzz::require_region(*m, info);
  return 0;
}
