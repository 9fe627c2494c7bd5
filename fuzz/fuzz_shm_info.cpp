// Copyright mstar-kv authors.
//
// The shm engine's descriptor decoder on an untrusted payload: it either
// throws Error(kCorruptDescriptor) or returns a value within its limits that
// encodes back to the same payload.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/shm.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info = fuzz::payload("shm", data, size);
  const auto s = fuzz::decoded([&] { return ShmKVTransferInfo::decode(info); });
  if (!s) return 0;
  fuzz::require(s->pid != 0 && s->nonce != 0, "pid or nonce 0 accepted");
  fuzz::require(s->size >= s->layout.total_bytes(), "size smaller than the layout accepted");
  s->layout.validate();  // must not throw
  fuzz::require(s->encode() == info, "decode(payload).encode() != payload");
  return 0;
}
