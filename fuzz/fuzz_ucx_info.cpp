// Copyright mstar-kv authors.
//
// The ucx engine's descriptor decoder (the generic RMA region underneath) on
// an untrusted payload: it throws Error(kCorruptDescriptor) or returns a
// region that fits its layout, does not wrap the address space, and encodes
// back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/engines/ucx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return mstar::kv::fuzz::fuzz_region_decoder<mstar::kv::UcxKVTransferInfo>("ucx", data, size);
}
