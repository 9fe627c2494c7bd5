// Copyright mstar-kv authors.
//
// The shm engine's descriptor decoder on an untrusted payload: it either
// throws Error(kCorruptDescriptor) or returns a value within its limits that
// encodes back to the same payload.
#include <cstdint>
#include <vector>

#include "fuzz_util.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/engines/shm.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info = fuzz::payload("shm", data, size);
  const auto s = fuzz::decoded([&] { return ShmKVTransferInfo::decode(info); });
  if (!s) return 0;
  fuzz::require(s->pid != 0 && s->nonce != 0, "pid or nonce 0 accepted");
  fuzz::require(s->size >= s->layout.total_bytes(), "size smaller than the layout accepted");
  s->layout.validate();                                // must not throw
  if (s->access == ShmKVTransferInfo::Access::kCma) {  // a private cache's regions
    const std::size_t n = s->regions.size();
    fuzz::require(n == 1 || (n == s->layout.num_layers && s->layout.layer_contiguous()),
                  "a region count other than 1 or one per layer accepted");
    fuzz::require(n == 1 ? s->region_bytes >= s->layout.total_bytes()
                         : s->region_bytes == s->layout.layer_bytes(),
                  "region bytes that do not hold the layout accepted");
    fuzz::require(s->anchor % 4096 == 0 && s->epochs_addr % 8 == 0 && s->ready_addr % 4 == 0,
                  "a misaligned anchor or table accepted");
    std::vector<NamedRange> ranges;
    for (std::uint64_t a : s->regions) ranges.push_back({"region", a, s->region_bytes});
    ranges.push_back({"epochs", s->epochs_addr, std::uint64_t{s->layout.num_pages} * 8});
    ranges.push_back({"ready", s->ready_addr, std::uint64_t{s->layout.num_pages} * 4});
    check_disjoint(ranges, StatusCode::kInternal, "fuzz");  // must not throw
  }
  fuzz::require(s->encode() == info, "decode(payload).encode() != payload");
  return 0;
}
