// Copyright mstar-kv authors.
#include <string>

#include "codec.hpp"
#include "mstar/kv/core/requests.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::size_t kOwnerDigits = 32;

bool is_hex_digit(char c) noexcept { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

}  // namespace

KVTransferInfo RequestKVTransferInfo::with_epoch(std::uint64_t epoch) const {
  return cache.with_epoch(epoch);
}

// Epochs go as runs (count, epoch): a publication's pages mostly share one.
std::vector<std::uint8_t> RequestKVTransferInfo::encode() const {
  codec::ByteWriter w;
  w.str(resource_key);
  w.str(request_id);
  w.str(label);
  w.boolean(reset_generation.has_value());
  w.u64(static_cast<std::uint64_t>(reset_generation.value_or(0)));
  w.u64(seq_len);
  w.u32(page_size);
  w.u32(static_cast<std::uint32_t>(page_indices.size()));
  for (std::uint32_t p : page_indices) w.u32(p);
  std::vector<std::pair<std::uint32_t, std::uint64_t>> runs;
  for (std::uint64_t e : page_epochs) {
    if (!runs.empty() && runs.back().second == e) {
      ++runs.back().first;
    } else {
      runs.emplace_back(1, e);
    }
  }
  w.u32(static_cast<std::uint32_t>(runs.size()));
  for (const auto& [count, epoch] : runs) {
    w.u32(count);
    w.u64(epoch);
  }
  w.str(owner);
  w.bytes(cache.encode());
  return codec::encode_frame(codec::FrameKind::kRequestInfo, w.data());
}

RequestKVTransferInfo RequestKVTransferInfo::decode(std::span<const std::uint8_t> bytes) {
  constexpr const char* kWhat = "RequestKVTransferInfo";
  auto payload = codec::decode_frame(bytes, codec::FrameKind::kRequestInfo, kWhat);
  codec::ByteReader r(payload, kWhat);
  RequestKVTransferInfo d;
  d.resource_key = r.str("resource_key", kMaxNameBytes);
  d.request_id = r.str("request_id", kMaxNameBytes);
  d.label = r.str("label", kMaxNameBytes);
  const bool has_generation = r.boolean("reset_generation");
  const std::uint64_t generation = r.u64("reset_generation");
  if (has_generation) {
    d.reset_generation = static_cast<std::int64_t>(generation);
  } else if (generation != 0) {
    r.fail("reset_generation", "no generation, yet value " + std::to_string(generation));
  }
  d.seq_len = r.u64("seq_len");
  d.page_size = r.u32_in("page_size", "page size", 1, LayoutLimits::kMaxPageSize);
  const std::uint32_t n = r.u32("page_count");
  if (n > DescriptorLimits::kMaxPagesPerSequence || std::size_t{n} * 4 > r.remaining()) {
    r.fail("page_count", std::to_string(n) + " pages: beyond the limit of " +
                             std::to_string(DescriptorLimits::kMaxPagesPerSequence) + " or the " +
                             std::to_string(r.remaining()) + " bytes left");
  }
  d.page_indices.resize(n);
  for (auto& p : d.page_indices) p = r.u32("page_indices");
  if (d.seq_len > std::uint64_t{n} * d.page_size) {
    r.fail("seq_len", std::to_string(d.seq_len) + " tokens do not fit in " + std::to_string(n) +
                          " pages of " + std::to_string(d.page_size));
  }
  const std::uint32_t runs = r.u32("epoch_runs");
  if (runs > n) {
    r.fail("epoch_runs", std::to_string(runs) + " runs for " + std::to_string(n) + " pages");
  }
  d.page_epochs.reserve(n);
  for (std::uint32_t i = 0; i < runs; ++i) {
    const std::uint32_t count = r.u32("epoch_runs");
    const std::uint64_t epoch = r.u64("page_epochs");
    if (epoch == 0) r.fail("page_epochs", "epoch 0 on a published page");
    if (count == 0 || count > n - d.page_epochs.size()) {
      r.fail("epoch_runs", "a run of " + std::to_string(count) + " epochs after " +
                               std::to_string(d.page_epochs.size()) + " of " + std::to_string(n) +
                               " pages");
    }
    d.page_epochs.insert(d.page_epochs.end(), count, epoch);
  }
  if (d.page_epochs.size() != n) {
    r.fail("page_epochs",
           std::to_string(d.page_epochs.size()) + " epochs for " + std::to_string(n) + " pages");
  }
  d.owner = r.str("owner", kOwnerDigits);
  if (d.owner.size() != kOwnerDigits) {
    r.fail("owner", std::to_string(d.owner.size()) + " characters, expected " +
                        std::to_string(kOwnerDigits) + " hex digits");
  }
  for (char c : d.owner) {
    if (!is_hex_digit(c)) r.fail("owner", "not lowercase hex digits");
  }
  d.cache = KVTransferInfo::decode(r.bytes("cache", DescriptorLimits::kMaxTransferPayload + 256));
  if (d.cache.empty()) r.fail("cache", "no engine: a local-only cache publishes no requests");
  if (d.cache.epoch != 0) {
    r.fail("cache", "the cache's descriptor carries epoch " + std::to_string(d.cache.epoch) +
                        ", expected 0 (epochs are per page)");
  }
  r.expect_end();
  return d;
}

}  // namespace mstar::kv
