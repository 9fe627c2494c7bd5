// Copyright mstar-kv authors.
#include <cstdio>
#include <string>

#include "core/codec.hpp"
#include "rma_backend.hpp"

namespace mstar::kv::rma {

namespace {

constexpr std::uint16_t kRegionVersion = 1;

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

std::vector<std::uint8_t> RmaRegionInfo::encode() const {
  codec::ByteWriter w;
  w.u16(kRegionVersion);
  w.str(entity_id);
  w.str(session_id);
  w.u64(data_ptr);
  w.u64(size);
  w.layout(layout);
  w.u64(generation);
  w.bytes(backend_blob);
  return w.take();
}

RmaRegionInfo RmaRegionInfo::decode(std::span<const std::uint8_t> payload) {
  codec::ByteReader r(payload, "RmaRegionInfo");
  const std::uint16_t version = r.u16("version");
  if (version != kRegionVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not the supported " +
                          std::to_string(kRegionVersion));
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
  return info;
}

void verify_region(const RmaRegionInfo& served, const RmaRegionInfo& claimed) {
  const std::string who = "peer '" + served.entity_id + "' at " + served.session_id;
  if (claimed.generation != served.generation) {
    throw Error(StatusCode::kStaleDescriptor,
                "descriptor generation " + std::to_string(claimed.generation) +
                    " is stale: " + who + " serves generation " +
                    std::to_string(served.generation));
  }
  if (claimed.entity_id != served.entity_id) {
    throw Error(StatusCode::kInvalidArgument,
                "descriptor names entity '" + claimed.entity_id + "' but " + who +
                    " is '" + served.entity_id + "'");
  }
  if (claimed.data_ptr != served.data_ptr || claimed.size != served.size) {
    throw Error(StatusCode::kPermissionDenied,
                "descriptor region [" + hex(claimed.data_ptr) + ", +" +
                    std::to_string(claimed.size) + ") is not the registered region [" +
                    hex(served.data_ptr) + ", +" + std::to_string(served.size) + ") of " +
                    who);
  }
  if (!(claimed.layout == served.layout)) {
    throw Error(StatusCode::kIncompatibleLayout,
                "descriptor layout " + claimed.layout.to_string() + " differs from " +
                    served.layout.to_string() + " served by " + who);
  }
  if (claimed.backend_blob != served.backend_blob) {
    throw Error(StatusCode::kPermissionDenied,
                "descriptor remote key (" + std::to_string(claimed.backend_blob.size()) +
                    " bytes) does not match the key of the region registered by " + who);
  }
}

}  // namespace mstar::kv::rma
