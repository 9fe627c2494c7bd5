// Copyright mstar-kv authors.
//
// The ucx engine's descriptor decoder (the generic RMA region underneath) on
// an untrusted payload: it throws Error(kCorruptDescriptor) or returns a
// region that fits its layout, does not wrap the address space, and encodes
// back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/status.hpp"
#include "mstar/kv/ucx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info{"ucx", std::vector<std::uint8_t>(data, data + size)};
  UcxKVTransferInfo u;
  try {
    u = UcxKVTransferInfo::decode(info);
  } catch (const Error& e) {
    fuzz::require(e.code() == StatusCode::kCorruptDescriptor, "decode threw a non-corrupt code");
    return 0;
  }
  fuzz::require(u.generation != 0 && u.data_ptr != 0, "zero generation or address accepted");
  fuzz::require(u.data_ptr + u.size >= u.data_ptr, "region wraps the address space");
  fuzz::require(u.layout.total_bytes() <= u.size, "layout larger than the region accepted");
  u.layout.validate();
  fuzz::require(u.encode() == info, "decode(payload) does not encode back to it");
  return 0;
}
