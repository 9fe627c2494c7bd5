// Copyright mstar-kv authors.
//
// The cuda_ipc engine's descriptor decoder (plain C++, no GPU needed) on an
// untrusted payload: it throws Error(kCorruptDescriptor) or returns a value
// that passes validate(), whose view lies inside the allocation, and that
// encodes and decodes again to the same fields.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mstar::kv;
  const KVTransferInfo info = fuzz::payload("cuda_ipc", data, size);
  const auto decoded = fuzz::decoded([&] { return CudaIpcKVTransferInfo::decode(info); });
  if (!decoded) return 0;
  const CudaIpcKVTransferInfo& c = *decoded;
  c.validate();  // must not throw
  c.layout.validate();
  fuzz::require(!c.requires_grad, "requires_grad accepted");
  fuzz::require(c.generation != 0 && c.owner_pid != 0, "zero generation or pid accepted");
  fuzz::require(c.offset >= 0, "negative offset accepted");
  fuzz::require(c.offset_bytes() <= c.cuda_share.allocation_bytes &&
                    c.layout.total_bytes() <= c.cuda_share.allocation_bytes - c.offset_bytes(),
                "view outside the allocation accepted");
  fuzz::require(c.size == CudaIpcKVTransferInfo::view_size(c.layout) &&
                    c.stride == CudaIpcKVTransferInfo::view_stride(c.layout),
                "a view other than the layout's accepted");
  const CudaIpcKVTransferInfo again = CudaIpcKVTransferInfo::decode(c.encode());
  fuzz::require(again.cuda_share == c.cuda_share && again.size == c.size &&
                    again.stride == c.stride && again.offset == c.offset &&
                    again.layout == c.layout && again.generation == c.generation &&
                    again.owner_pid == c.owner_pid,
                "encode/decode changed the value");
  return 0;
}
