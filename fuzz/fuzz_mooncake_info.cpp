// Copyright mstar-kv authors.
//
// The mooncake engine's descriptor decoder on an untrusted payload: it
// throws Error(kCorruptDescriptor) or returns a value that fits its layout
// and encodes back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/status.hpp"
#include "mstar/kv/mooncake.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info{"mooncake", std::vector<std::uint8_t>(data, data + size)};
  MooncakeKVTransferInfo m;
  try {
    m = MooncakeKVTransferInfo::decode(info);
  } catch (const Error& e) {
    fuzz::require(e.code() == StatusCode::kCorruptDescriptor, "decode threw a non-corrupt code");
    return 0;
  }
  fuzz::require(m.generation != 0 && m.data_ptr != 0, "zero generation or address accepted");
  fuzz::require(m.data_ptr + m.size >= m.data_ptr, "region wraps the address space");
  fuzz::require(m.layout.total_bytes() <= m.size, "layout larger than the region accepted");
  m.layout.validate();
  fuzz::require(m.encode() == info, "decode(payload) does not encode back to it");
  return 0;
}
