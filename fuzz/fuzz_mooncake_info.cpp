// Copyright mstar-kv authors.
//
// The mooncake engine's descriptor decoder on an untrusted payload: it
// throws Error(kCorruptDescriptor) or returns a value that fits its layout
// and encodes back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/engines/mooncake.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return mstar::kv::fuzz::fuzz_region_decoder<mstar::kv::MooncakeKVTransferInfo>("mooncake", data,
                                                                                 size);
}
