// Copyright mstar-kv authors.
#include "mstar/kv/core/descriptor.hpp"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "codec.hpp"
#include "mstar/kv/util/status.hpp"

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

// page_epochs travels as an optional section after a frame's last field
// (tag, count, entries), written only when it is not empty: an unshared
// descriptor keeps the bytes it had before the field existed, and a frame
// from before it decodes as one without exceptions. A reader that predates
// the section refuses a frame that carries one (trailing bytes) instead of
// reading shared pages with the wrong epoch.
constexpr std::uint8_t kPageEpochsTag = 1;
constexpr std::size_t kPageEpochBytes = 4 + 8;

void write_page_epochs(codec::ByteWriter& w, const KVTransferInfo& info) {
  if (info.page_epochs.empty()) return;
  w.u8(kPageEpochsTag);
  w.u32(static_cast<std::uint32_t>(info.page_epochs.size()));
  for (const PageEpoch& pe : info.page_epochs) {
    w.u32(pe.page);
    w.u64(pe.epoch);
  }
}

// The section, if the frame has one; other bytes are left to expect_end,
// which refuses them as trailing bytes.
void read_page_epochs(codec::ByteReader& r, KVTransferInfo& info) {
  if (!r.next_is(kPageEpochsTag)) return;
  r.u8("page_epochs");
  const std::uint32_t n = r.u32("page_epochs");
  if (n == 0) r.fail("page_epochs", "an empty section (a descriptor without exceptions has none)");
  if (n > DescriptorLimits::kMaxPagesPerSequence) {
    r.fail("page_epochs", std::to_string(n) + " entries exceed the limit of " +
                              std::to_string(DescriptorLimits::kMaxPagesPerSequence));
  }
  if (std::size_t{n} * kPageEpochBytes > r.remaining()) {
    r.fail("page_epochs", "truncated: " + std::to_string(n) + " entries need " +
                              std::to_string(std::size_t{n} * kPageEpochBytes) + " bytes, " +
                              std::to_string(r.remaining()) + " left");
  }
  if (info.engine.empty() || info.epoch == 0) {
    r.fail("page_epochs", std::to_string(n) + " entries on a descriptor without an epoch (" +
                              (info.engine.empty() ? "local-only" : "epoch 0") +
                              "): only a published sequence's descriptor carries them");
  }
  info.page_epochs.resize(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    PageEpoch& pe = info.page_epochs[i];
    pe.page = r.u32("page_epochs");
    pe.epoch = r.u64("page_epochs");
    if (i > 0 && pe.page <= info.page_epochs[i - 1].page) {
      r.fail("page_epochs", "entry " + std::to_string(i) + " names page " +
                                std::to_string(pe.page) + " after page " +
                                std::to_string(info.page_epochs[i - 1].page) +
                                ": pages must be ascending and named once");
    }
    if (pe.epoch == 0 || pe.epoch == info.epoch) {
      r.fail("page_epochs",
             "page " + std::to_string(pe.page) + " carries epoch " + std::to_string(pe.epoch) +
                 (pe.epoch == 0 ? " (0 is a free page)" : ", the descriptor's own (no exception)"));
    }
  }
}

}  // namespace

std::uint64_t KVTransferInfo::epoch_of(std::uint32_t page) const noexcept {
  auto it = std::lower_bound(page_epochs.begin(), page_epochs.end(), page,
                             [](const PageEpoch& pe, std::uint32_t p) { return pe.page < p; });
  return it != page_epochs.end() && it->page == page ? it->epoch : epoch;
}

KVTransferInfo KVTransferInfo::with_epoch(std::uint64_t e) const {
  return KVTransferInfo{engine, payload, e, {}};
}

std::vector<std::uint8_t> KVTransferInfo::encode() const {
  codec::ByteWriter w;
  write_transfer_info(w, *this);
  write_page_epochs(w, *this);
  return codec::encode_frame(codec::FrameKind::kTransferInfo, w.data());
}

KVTransferInfo KVTransferInfo::decode(std::span<const std::uint8_t> bytes) {
  auto payload = codec::decode_frame(bytes, codec::FrameKind::kTransferInfo, "KVTransferInfo");
  codec::ByteReader r(payload, "KVTransferInfo");
  KVTransferInfo info = read_transfer_info(r);
  read_page_epochs(r, info);
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
  write_page_epochs(w, kv_transfer_info);
  return codec::encode_frame(codec::FrameKind::kSequenceInfo, w.data());
}

SequenceInfo SequenceInfo::decode(std::span<const std::uint8_t> bytes) {
  auto payload = codec::decode_frame(bytes, codec::FrameKind::kSequenceInfo, "SequenceInfo");
  codec::ByteReader r(payload, "SequenceInfo");
  SequenceInfo s;
  s.seq_id = r.u64("seq_id");
  s.num_tokens = r.u64("num_tokens");
  s.page_size = r.u32_in("page_size", "page size", 1, LayoutLimits::kMaxPageSize);
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
  read_page_epochs(r, s.kv_transfer_info);
  r.expect_end();
  if (!s.kv_transfer_info.page_epochs.empty()) {
    const std::unordered_set<std::uint32_t> own(s.page_indices.begin(), s.page_indices.end());
    for (const PageEpoch& pe : s.kv_transfer_info.page_epochs) {
      if (own.count(pe.page) == 0) {
        r.fail("page_epochs", "page " + std::to_string(pe.page) + " is not one of the sequence's " +
                                  std::to_string(s.page_indices.size()) + " pages");
      }
    }
  }
  return s;
}

}  // namespace mstar::kv
