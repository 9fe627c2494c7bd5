// Copyright mstar-kv authors.
//
// RegionMap: where the bytes of a cache are.
//
// Planners, descriptors and engines name a cache's bytes by their offset in
// its layout (KVLayout::block_offset, in [0, total_bytes())); a RegionMap
// turns such an offset into an address. A cache lives in one region
// (address = base + offset) or, when its layout is layer_contiguous()
// (layer-major and layer-page caches), in one region per layer, each
// anywhere and holding exactly that layer's bytes in the layout's order
// (address = region[layer] + offset - layer * layer_bytes): vLLM's
// per-layer tensors. The planner never emits a copy that crosses a layer
// boundary of a layer-contiguous cache (planner.hpp), so the address of a
// copy's first byte maps the whole copy.
//
// Value type, cheap to copy (the table of a per-layer map is shared); every
// method is const and safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

class RegionMap {
 public:
  // Nothing mapped: address(offset) == offset.
  RegionMap() = default;
  // One region at `base`.
  static RegionMap contiguous(std::uint64_t base) noexcept {
    RegionMap m;
    m.base_ = base;
    return m;
  }
  // One region per layer of `layout`, region l at bases[l]. Throws
  // Error(kInvalidArgument) unless the layout is layer_contiguous() and
  // bases has one nonzero entry per layer (the ranges' overlaps are the
  // caller's to check: check_disjoint).
  static RegionMap per_layer(const KVLayout& layout, std::vector<std::uint64_t> bases);

  // True for a map of one region per layer.
  bool split() const noexcept { return layer_bytes_ != 0; }
  // 1, or the number of layers.
  std::size_t count() const noexcept { return split() ? bases_->size() : 1; }
  // Bytes of each region of a split map (the layout's layer_bytes); 0 for
  // one region.
  std::uint64_t layer_bytes() const noexcept { return layer_bytes_; }
  // The address of region i (< count()).
  std::uint64_t base(std::size_t i = 0) const noexcept { return split() ? (*bases_)[i] : base_; }

  // The address of the byte at `offset`; for a split map the offset must
  // be inside the layout (the planner's offsets are).
  std::uint64_t address(std::uint64_t offset) const noexcept {
    if (layer_bytes_ == 0) return base_ + offset;
    const std::uint64_t layer = offset / layer_bytes_;
    return (*bases_)[layer] + (offset - layer * layer_bytes_);
  }
  template <typename T = std::byte>
  T* pointer(std::uint64_t offset) const noexcept {
    return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address(offset)));
  }
  // How many of the `length` bytes from `offset` lie in offset's region
  // (all of them for one region): runs that never cross a region's end.
  std::uint64_t run_bytes(std::uint64_t offset, std::uint64_t length) const noexcept {
    if (layer_bytes_ == 0) return length;
    const std::uint64_t left = layer_bytes_ - offset % layer_bytes_;
    return length < left ? length : left;
  }

  bool operator==(const RegionMap& o) const noexcept;

 private:
  std::uint64_t base_ = 0;
  std::uint64_t layer_bytes_ = 0;
  std::shared_ptr<const std::vector<std::uint64_t>> bases_;
};

// One address range to check, with its name for messages ("layer 3").
struct NamedRange {
  std::string name;
  std::uint64_t address = 0;
  std::uint64_t size = 0;
};

// Throws Error(code) naming both ranges ("<who>: layer 3 [0x..., +n)
// overlaps layer 1 [0x..., +m)") when two of `ranges` share a byte, and
// naming the range when one is null or runs past the end of the 64-bit
// address space. O(n log n).
void check_disjoint(std::vector<NamedRange> ranges, StatusCode code, const std::string& who);

// "0x7f12345000".
std::string hex_address(std::uint64_t address);

}  // namespace mstar::kv
