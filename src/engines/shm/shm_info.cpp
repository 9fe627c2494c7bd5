// Copyright mstar-kv authors.
//
// ShmKVTransferInfo <-> KVTransferInfo payload. Payload version 1 (kMemfd):
// u8 version, u32 pid, u32 fd, u32 uid, u64 start_time, u64 nonce, u64 size,
// layout. Version 2 (kCma): u8 version, u32 pid, u32 uid, u64 start_time,
// u64 nonce, u64 size, layout, u64 anchor, u64 epochs_addr, u64 ready_addr,
// u64 region_bytes, u32 count, count x u64 region address. Version 3 (kCma,
// backed: map_private): version 2's fields, then u32 fd, u8 flags (bit 0:
// backed_tables).
#include <string>

#include "cma_anchor.hpp"
#include "core/codec.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/engines/shm.hpp"

namespace mstar::kv {

namespace {

constexpr std::uint8_t kPayloadVersion = 1;        // kMemfd
constexpr std::uint8_t kCmaPayloadVersion = 2;     // kCma
constexpr std::uint8_t kBackedPayloadVersion = 3;  // kCma, its whole pages in a memfd
// Linux's PID_MAX_LIMIT (2^22) and a generous descriptor-table bound.
constexpr std::uint32_t kMaxPid = 1u << 22;
constexpr std::uint32_t kMaxFd = 1u << 30;

}  // namespace

KVTransferInfo ShmKVTransferInfo::encode() const {
  codec::ByteWriter w;
  if (access == Access::kCma) {
    w.u8(backed ? kBackedPayloadVersion : kCmaPayloadVersion);
    w.u32(pid);
    w.u32(uid);
    w.u64(start_time);
    w.u64(nonce);
    w.u64(size);
    w.layout(layout);
    w.u64(anchor);
    w.u64(epochs_addr);
    w.u64(ready_addr);
    w.u64(region_bytes);
    w.u32(static_cast<std::uint32_t>(regions.size()));
    for (std::uint64_t a : regions) w.u64(a);
    if (backed) {
      w.u32(fd);
      w.u8(backed_tables ? 1 : 0);
    }
    return KVTransferInfo{kEngineName, w.take()};
  }
  w.u8(kPayloadVersion);
  w.u32(pid);
  w.u32(fd);
  w.u32(uid);
  w.u64(start_time);
  w.u64(nonce);
  w.u64(size);
  w.layout(layout);
  return KVTransferInfo{kEngineName, w.take()};
}

namespace {

// The kCma part after the layout: untrusted, every address and count
// checked before anything reads the owner's memory.
void decode_cma(codec::ByteReader& r, ShmKVTransferInfo& s, bool backed) {
  const KVLayout& l = s.layout;
  s.access = ShmKVTransferInfo::Access::kCma;
  s.anchor = r.u64("anchor");
  if (s.anchor == 0 || s.anchor % 4096 != 0) {
    r.fail("anchor", "anchor address " + hex_address(s.anchor) + " is not a page's");
  }
  s.epochs_addr = r.u64("epochs_addr");
  if (s.epochs_addr == 0 || s.epochs_addr % 8 != 0) {
    r.fail("epochs_addr", "page epoch table address " + hex_address(s.epochs_addr) +
                              " is null or not 8-byte aligned");
  }
  s.ready_addr = r.u64("ready_addr");
  if (s.ready_addr == 0 || s.ready_addr % 4 != 0) {
    r.fail("ready_addr", "readiness words address " + hex_address(s.ready_addr) +
                             " is null or not 4-byte aligned");
  }
  s.region_bytes = r.u64("region_bytes");
  const std::uint32_t count = r.u32("regions");
  if (count == 0 || count > ShmKVTransferInfo::kMaxRegions) {
    r.fail("regions", "region count " + std::to_string(count) + " out of range [1, " +
                          std::to_string(ShmKVTransferInfo::kMaxRegions) + "]");
  }
  if (count != 1 && (count != l.num_layers || !l.layer_contiguous())) {
    r.fail("regions", "region count " + std::to_string(count) +
                          " is neither 1 nor one per layer (" + std::to_string(l.num_layers) +
                          ") of a layer-contiguous layout (" +
                          std::string(to_string(l.cache_order)) + "-major)");
  }
  const bool split = count > 1;
  if (split ? s.region_bytes != l.layer_bytes()
            : s.region_bytes < l.total_bytes() || s.region_bytes > LayoutLimits::kMaxTotalBytes) {
    r.fail("region_bytes",
           "region bytes " + std::to_string(s.region_bytes) +
               (split ? " differ from the layout's layer bytes " + std::to_string(l.layer_bytes())
                      : " outside [" + std::to_string(l.total_bytes()) + ", " +
                            std::to_string(LayoutLimits::kMaxTotalBytes) + "]"));
  }
  if (s.size != (split ? l.total_bytes() : s.region_bytes)) {
    r.fail("size", "size " + std::to_string(s.size) + " is not the regions' " +
                       std::to_string(split ? l.total_bytes() : s.region_bytes) + " bytes");
  }
  s.regions.resize(count);
  for (std::uint32_t i = 0; i < count; ++i) s.regions[i] = r.u64("region address");
  if (backed) {
    s.backed = true;
    s.fd = r.u32("fd");
    if (s.fd > kMaxFd) {
      r.fail("fd",
             "fd " + std::to_string(s.fd) + " out of range [0, " + std::to_string(kMaxFd) + "]");
    }
    const std::uint8_t flags = r.u8("flags");
    if (flags > 1) r.fail("flags", "flags " + std::to_string(flags) + " are not 0 or 1");
    s.backed_tables = flags == 1;
    if (s.backed_tables && (s.epochs_addr % 4096 != 0 || s.ready_addr % 4096 != 0)) {
      r.fail("flags", "tables at " + hex_address(s.epochs_addr) + " and " +
                          hex_address(s.ready_addr) +
                          " are not page-aligned, as backed "
                          "tables are");
    }
  }
  r.expect_end();
  std::vector<NamedRange> ranges;
  ranges.reserve(count + 3);
  for (std::uint32_t i = 0; i < count; ++i) {
    ranges.push_back({split ? "layer " + std::to_string(i) + " region" : "the cache region",
                      s.regions[i], s.region_bytes});
  }
  ranges.push_back({"the page epoch table", s.epochs_addr, std::uint64_t{l.num_pages} * 8});
  ranges.push_back({"the readiness words", s.ready_addr, std::uint64_t{l.num_pages} * 4});
  ranges.push_back({"the anchor", s.anchor, shm::anchor_bytes(count)});
  // Beyond the user address space of any 64-bit Linux (57-bit with 5-level
  // page tables) no process has memory.
  constexpr std::uint64_t kUserSpaceEnd = 1ull << 57;
  for (const NamedRange& x : ranges) {
    if (x.address >= kUserSpaceEnd || x.size > kUserSpaceEnd - x.address) {
      r.fail("regions", x.name + " [" + hex_address(x.address) + ", +" + std::to_string(x.size) +
                            ") lies beyond the user address space (" + hex_address(kUserSpaceEnd) +
                            ")");
    }
  }
  try {
    check_disjoint(std::move(ranges), StatusCode::kCorruptDescriptor, "ShmKVTransferInfo");
  } catch (const Error& e) {
    r.fail("regions", e.status().message());
  }
}

}  // namespace

ShmKVTransferInfo ShmKVTransferInfo::decode(const KVTransferInfo& info) {
  if (info.engine != kEngineName) {
    throw Error(StatusCode::kInvalidArgument,
                "the shm engine cannot read a descriptor of engine '" +
                    (info.engine.empty() ? std::string("local (none)") : info.engine) +
                    "', expected 'shm'");
  }
  codec::ByteReader r(info.payload, "ShmKVTransferInfo");
  const std::uint8_t version = r.u8("version");
  if (version < kPayloadVersion || version > kBackedPayloadVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not supported (expected " +
                          std::to_string(kPayloadVersion) + " to " +
                          std::to_string(kBackedPayloadVersion) + ")");
  }
  const bool cma = version != kPayloadVersion;
  ShmKVTransferInfo s;
  s.pid = r.u32("pid");
  if (s.pid == 0 || s.pid > kMaxPid) {
    r.fail("pid",
           "pid " + std::to_string(s.pid) + " out of range [1, " + std::to_string(kMaxPid) + "]");
  }
  if (!cma) {
    s.fd = r.u32("fd");
    if (s.fd > kMaxFd) {
      r.fail("fd",
             "fd " + std::to_string(s.fd) + " out of range [0, " + std::to_string(kMaxFd) + "]");
    }
  }
  s.uid = r.u32("uid");
  s.start_time = r.u64("start_time");
  if (s.start_time == 0) r.fail("start_time", "start time 0 is not a process's");
  s.nonce = r.u64("nonce");
  if (s.nonce == 0) r.fail("nonce", "nonce 0 is never chosen");
  s.size = r.u64("size");
  s.layout = r.layout("layout");
  if (cma) {
    decode_cma(r, s, version == kBackedPayloadVersion);
    return s;
  }
  if (s.size < s.layout.total_bytes() || s.size > LayoutLimits::kMaxTotalBytes) {
    r.fail("size", "size " + std::to_string(s.size) + " outside [" +
                       std::to_string(s.layout.total_bytes()) + ", " +
                       std::to_string(LayoutLimits::kMaxTotalBytes) +
                       "] (the layout's bytes, the limit)");
  }
  r.expect_end();
  return s;
}

}  // namespace mstar::kv
