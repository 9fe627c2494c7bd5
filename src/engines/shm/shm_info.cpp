// Copyright mstar-kv authors.
//
// ShmKVTransferInfo <-> KVTransferInfo payload. Payload: u8 version, u32 pid,
// u32 fd, u32 uid, u64 start_time, u64 nonce, u64 size, layout.
#include <string>

#include "core/codec.hpp"
#include "mstar/kv/shm.hpp"

namespace mstar::kv {

namespace {

constexpr std::uint8_t kPayloadVersion = 1;
// Linux's PID_MAX_LIMIT (2^22) and a generous descriptor-table bound.
constexpr std::uint32_t kMaxPid = 1u << 22;
constexpr std::uint32_t kMaxFd = 1u << 30;

}  // namespace

KVTransferInfo ShmKVTransferInfo::encode() const {
  codec::ByteWriter w;
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

ShmKVTransferInfo ShmKVTransferInfo::decode(const KVTransferInfo& info) {
  if (info.engine != kEngineName) {
    throw Error(StatusCode::kInvalidArgument,
                "the shm engine cannot read a descriptor of engine '" +
                    (info.engine.empty() ? std::string("local (none)") : info.engine) +
                    "', expected 'shm'");
  }
  codec::ByteReader r(info.payload, "ShmKVTransferInfo");
  const std::uint8_t version = r.u8("version");
  if (version != kPayloadVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not supported (expected " +
                          std::to_string(kPayloadVersion) + ")");
  }
  ShmKVTransferInfo s;
  s.pid = r.u32("pid");
  if (s.pid == 0 || s.pid > kMaxPid) {
    r.fail("pid", "pid " + std::to_string(s.pid) + " out of range [1, " +
                      std::to_string(kMaxPid) + "]");
  }
  s.fd = r.u32("fd");
  if (s.fd > kMaxFd) {
    r.fail("fd", "fd " + std::to_string(s.fd) + " out of range [0, " +
                     std::to_string(kMaxFd) + "]");
  }
  s.uid = r.u32("uid");
  s.start_time = r.u64("start_time");
  if (s.start_time == 0) r.fail("start_time", "start time 0 is not a process's");
  s.nonce = r.u64("nonce");
  if (s.nonce == 0) r.fail("nonce", "nonce 0 is never chosen");
  s.size = r.u64("size");
  s.layout = r.layout("layout");
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
