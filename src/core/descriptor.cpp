// Copyright mstar-kv authors.
#include "mstar/kv/descriptor.hpp"

#include <string>

#include "codec.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace {

void write_transfer_info(codec::ByteWriter& w, const KVTransferInfo& info) {
  w.str(info.engine);
  w.bytes(info.payload);
  w.u64(info.epoch);
}

KVTransferInfo read_transfer_info(codec::ByteReader& r) {
  KVTransferInfo info;
  info.engine = r.str("engine", DescriptorLimits::kMaxEngineName);
  for (char c : info.engine) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    if (!ok) r.fail("engine", "engine name must be [a-z0-9_]+");
  }
  auto payload = r.bytes("payload", DescriptorLimits::kMaxTransferPayload);
  info.payload.assign(payload.begin(), payload.end());
  if (info.engine.empty() && !info.payload.empty()) {
    r.fail("payload", "a local-only (empty) transfer info carries " +
                          std::to_string(info.payload.size()) + " payload bytes, expected 0");
  }
  info.epoch = r.u64("epoch");
  if (info.engine.empty() && info.epoch != 0) {
    r.fail("epoch", "a local-only (empty) transfer info carries epoch " +
                        std::to_string(info.epoch) + ", expected 0");
  }
  return info;
}

}  // namespace

std::vector<std::uint8_t> KVTransferInfo::encode() const {
  codec::ByteWriter w;
  write_transfer_info(w, *this);
  return codec::encode_frame(codec::FrameKind::kTransferInfo, w.data());
}

KVTransferInfo KVTransferInfo::decode(std::span<const std::uint8_t> bytes) {
  auto payload = codec::decode_frame(bytes, codec::FrameKind::kTransferInfo, "KVTransferInfo");
  codec::ByteReader r(payload, "KVTransferInfo");
  KVTransferInfo info = read_transfer_info(r);
  r.expect_end();
  return info;
}

std::vector<std::uint8_t> SequenceInfo::encode() const {
  codec::ByteWriter w;
  w.u64(seq_id);
  w.u64(num_tokens);
  w.u32(page_size);
  w.u32(static_cast<std::uint32_t>(page_indices.size()));
  for (std::uint32_t p : page_indices) w.u32(p);
  write_transfer_info(w, kv_transfer_info);
  w.u64(lease_expiry_ms);
  return codec::encode_frame(codec::FrameKind::kSequenceInfo, w.data());
}

SequenceInfo SequenceInfo::decode(std::span<const std::uint8_t> bytes) {
  auto payload = codec::decode_frame(bytes, codec::FrameKind::kSequenceInfo, "SequenceInfo");
  codec::ByteReader r(payload, "SequenceInfo");
  SequenceInfo s;
  s.seq_id = r.u64("seq_id");
  s.num_tokens = r.u64("num_tokens");
  s.page_size = r.u32("page_size");
  if (s.page_size == 0 || s.page_size > LayoutLimits::kMaxPageSize) {
    r.fail("page_size", "page size " + std::to_string(s.page_size) + " out of range [1, " +
                            std::to_string(LayoutLimits::kMaxPageSize) + "]");
  }
  const std::uint32_t n = r.u32("page_count");
  if (n > DescriptorLimits::kMaxPagesPerSequence) {
    r.fail("page_count", std::to_string(n) + " pages exceed the limit of " +
                             std::to_string(DescriptorLimits::kMaxPagesPerSequence));
  }
  if (std::size_t{n} * 4 > r.remaining()) {
    r.fail("page_indices", "truncated: " + std::to_string(n) + " pages need " +
                               std::to_string(std::size_t{n} * 4) + " bytes, " +
                               std::to_string(r.remaining()) + " left");
  }
  // Exactly the pages the tokens fill: not (t + ps - 1) / ps, which wraps
  // for a num_tokens near 2^64.
  const std::uint64_t needed =
      s.num_tokens / s.page_size + (s.num_tokens % s.page_size != 0 ? 1 : 0);
  if (needed != n) {
    r.fail("page_count", std::to_string(n) + " pages for " + std::to_string(s.num_tokens) +
                             " tokens of page size " + std::to_string(s.page_size) + ": expected " +
                             std::to_string(needed));
  }
  s.page_indices.resize(n);
  for (auto& p : s.page_indices) p = r.u32("page_indices");
  s.kv_transfer_info = read_transfer_info(r);
  s.lease_expiry_ms = r.u64("lease_expiry_ms");
  r.expect_end();
  return s;
}

}  // namespace mstar::kv
