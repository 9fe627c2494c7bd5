// Copyright mstar-kv authors.
#include <cstdio>
#include <string>

#include "core/codec.hpp"
#include "rma_backend.hpp"

namespace mstar::kv::rma {

namespace {

constexpr std::uint16_t kRegionVersion = 1;
// Version 2: version 1's fields, then u32 count and the layer regions.
constexpr std::uint16_t kLayerRegionsVersion = 2;

std::string hex(std::uint64_t v) { return hex_address(v); }

}  // namespace

std::vector<std::uint8_t> RmaRegionInfo::encode() const {
  codec::ByteWriter w;
  w.u16(layer_regions.empty() ? kRegionVersion : kLayerRegionsVersion);
  w.str(entity_id);
  w.str(session_id);
  w.u64(data_ptr);
  w.u64(size);
  w.layout(layout);
  w.u64(generation);
  w.bytes(backend_blob);
  if (!layer_regions.empty()) {
    w.u32(static_cast<std::uint32_t>(layer_regions.size()));
    for (std::uint64_t a : layer_regions) w.u64(a);
  }
  return w.take();
}

RmaRegionInfo RmaRegionInfo::decode(std::span<const std::uint8_t> payload) {
  codec::ByteReader r(payload, "RmaRegionInfo");
  const std::uint16_t version = r.u16("version");
  if (version != kRegionVersion && version != kLayerRegionsVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not a supported one (" +
                          std::to_string(kRegionVersion) + ", " +
                          std::to_string(kLayerRegionsVersion) + ")");
  }
  RmaRegionInfo info;
  info.entity_id = r.str("entity_id", kMaxIdBytes);
  info.session_id = r.str("session_id", kMaxIdBytes);
  info.data_ptr = r.u64("data_ptr");
  info.size = r.u64("size");
  info.layout = r.layout("layout");
  info.generation = r.u64("generation");
  auto blob = r.bytes("backend_blob", kMaxBlobBytes);
  info.backend_blob.assign(blob.begin(), blob.end());
  if (version == kLayerRegionsVersion) {
    const std::uint32_t count = r.u32("layer_regions");
    if (count != info.layout.num_layers || !info.layout.layer_contiguous() || count < 2) {
      r.fail("layer_regions",
             std::to_string(count) + " layer regions for a " +
                 std::string(to_string(info.layout.cache_order)) + "-major layout of " +
                 std::to_string(info.layout.num_layers) +
                 " layers (one per layer of a layer-contiguous layout of 2 or more)");
    }
    info.layer_regions.resize(count);
    for (std::uint64_t& a : info.layer_regions) a = r.u64("layer region");
  }
  r.expect_end();
  if (info.generation == 0) r.fail("generation", "generation 0 is never issued");
  if (info.data_ptr == 0) r.fail("data_ptr", "null base address");
  if (info.data_ptr + info.size < info.data_ptr) {
    r.fail("size", "region " + hex(info.data_ptr) + " + " + std::to_string(info.size) +
                       " bytes overflows the address space");
  }
  if (info.layout.total_bytes() > info.size) {
    r.fail("layout", "layout needs " + std::to_string(info.layout.total_bytes()) +
                         " bytes, region holds " + std::to_string(info.size));
  }
  if (info.session_id.empty()) r.fail("session_id", "empty session id");
  if (!info.layer_regions.empty()) {
    const std::uint64_t lb = info.layout.layer_bytes();
    if (info.size != info.layout.total_bytes() || info.data_ptr != info.layer_regions[0]) {
      r.fail("layer_regions", "a cache of layer regions has size " +
                                  std::to_string(info.layout.total_bytes()) +
                                  " and data_ptr at layer 0's region, got size " +
                                  std::to_string(info.size) + " at " + hex(info.data_ptr));
    }
    std::vector<NamedRange> ranges;
    ranges.reserve(info.layer_regions.size());
    for (std::size_t l = 0; l < info.layer_regions.size(); ++l) {
      ranges.push_back({"layer " + std::to_string(l) + " region", info.layer_regions[l], lb});
    }
    try {
      check_disjoint(std::move(ranges), StatusCode::kCorruptDescriptor, "RmaRegionInfo");
    } catch (const Error& e) {
      r.fail("layer_regions", e.status().message());
    }
  }
  return info;
}

RegionMap RmaRegionInfo::region_map() const {
  return layer_regions.empty() ? RegionMap::contiguous(data_ptr)
                               : RegionMap::per_layer(layout, layer_regions);
}

void verify_region(const RmaRegionInfo& served, const RmaRegionInfo& claimed) {
  const std::string who = "peer '" + served.entity_id + "' at " + served.session_id;
  if (claimed.generation != served.generation) {
    throw Error(StatusCode::kStaleDescriptor,
                "descriptor generation " + std::to_string(claimed.generation) + " is stale: " +
                    who + " serves generation " + std::to_string(served.generation));
  }
  if (claimed.entity_id != served.entity_id) {
    throw Error(StatusCode::kInvalidArgument, "descriptor names entity '" + claimed.entity_id +
                                                  "' but " + who + " is '" + served.entity_id +
                                                  "'");
  }
  if (claimed.data_ptr != served.data_ptr || claimed.size != served.size) {
    throw Error(StatusCode::kPermissionDenied,
                "descriptor region [" + hex(claimed.data_ptr) + ", +" +
                    std::to_string(claimed.size) + ") is not the registered region [" +
                    hex(served.data_ptr) + ", +" + std::to_string(served.size) + ") of " + who);
  }
  if (claimed.layer_regions != served.layer_regions) {
    throw Error(StatusCode::kPermissionDenied,
                "descriptor names " + std::to_string(claimed.layer_regions.size()) +
                    " layer regions that are not the " +
                    std::to_string(served.layer_regions.size()) + " registered by " + who);
  }
  if (!(claimed.layout == served.layout)) {
    throw Error(StatusCode::kIncompatibleLayout, "descriptor layout " + claimed.layout.to_string() +
                                                     " differs from " + served.layout.to_string() +
                                                     " served by " + who);
  }
  if (claimed.backend_blob != served.backend_blob) {
    throw Error(StatusCode::kPermissionDenied,
                "descriptor remote key (" + std::to_string(claimed.backend_blob.size()) +
                    " bytes) does not match the key of the region registered by " + who);
  }
}

}  // namespace mstar::kv::rma
