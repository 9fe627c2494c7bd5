// Copyright mstar-kv authors.
#include "mstar/kv/core/regions.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

namespace mstar::kv {

RegionMap RegionMap::per_layer(const KVLayout& layout, std::vector<std::uint64_t> bases) {
  if (!layout.layer_contiguous()) {
    throw Error(StatusCode::kInvalidArgument,
                "one region per layer needs a layout whose layers are contiguous, got " +
                    std::string(to_string(layout.cache_order)) + "-major");
  }
  if (bases.size() != layout.num_layers) {
    throw Error(StatusCode::kInvalidArgument,
                "one region per layer needs " + std::to_string(layout.num_layers) +
                    " addresses (the layout's num_layers), got " + std::to_string(bases.size()));
  }
  for (std::size_t l = 0; l < bases.size(); ++l) {
    if (bases[l] == 0) {
      throw Error(StatusCode::kInvalidArgument,
                  "the region of layer " + std::to_string(l) + " is at address 0");
    }
  }
  RegionMap m;
  m.layer_bytes_ = layout.layer_bytes();
  m.bases_ = std::make_shared<const std::vector<std::uint64_t>>(std::move(bases));
  return m;
}

bool RegionMap::operator==(const RegionMap& o) const noexcept {
  if (split() != o.split()) return false;
  if (!split()) return base_ == o.base_;
  return layer_bytes_ == o.layer_bytes_ && *bases_ == *o.bases_;
}

std::string hex_address(std::uint64_t address) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

namespace {

std::string describe(const NamedRange& r) {
  return r.name + " [" + hex_address(r.address) + ", +" + std::to_string(r.size) + ")";
}

}  // namespace

void check_disjoint(std::vector<NamedRange> ranges, StatusCode code, const std::string& who) {
  for (const NamedRange& r : ranges) {
    if (r.address == 0) throw Error(code, who + ": " + describe(r) + " is at address 0");
    if (r.address + r.size < r.address) {
      throw Error(code, who + ": " + describe(r) + " runs past the end of the address space");
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const NamedRange& a, const NamedRange& b) { return a.address < b.address; });
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    const NamedRange& a = ranges[i - 1];
    const NamedRange& b = ranges[i];
    if (a.size != 0 && b.size != 0 && b.address < a.address + a.size) {
      throw Error(code, who + ": " + describe(b) + " overlaps " + describe(a));
    }
  }
}

}  // namespace mstar::kv
