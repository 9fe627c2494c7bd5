// Copyright mstar-kv authors.
//
// Descriptors: what one process tells another so that it can read its cache.
// Both types serialise to versioned, self-describing, checksummed bytes
// ("MSKV" frame). Decoding treats the bytes as untrusted input: truncated,
// oversized, wrong-version, corrupted or inconsistent bytes throw
// Error(kCorruptDescriptor) naming the field, never crash or over-read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mstar::kv {

// Limits on decoded descriptors.
struct DescriptorLimits {
  static constexpr std::size_t kMaxFrameBytes = 64u << 20;
  static constexpr std::size_t kMaxEngineName = 64;
  static constexpr std::size_t kMaxTransferPayload = 64u << 10;
  static constexpr std::size_t kMaxPagesPerSequence = 1u << 24;
};

// One page whose epoch differs from its descriptor's (KVTransferInfo::page_epochs).
struct PageEpoch {
  std::uint32_t page = 0;
  std::uint64_t epoch = 0;

  bool operator==(const PageEpoch&) const = default;
};

// An engine's descriptor of its cache, opaque outside that engine: the
// engine's name ("shm", "ucx", "mooncake", "cuda_ipc") plus the payload that
// engine encoded. An empty engine name stands for "no transfer engine"
// (LocalOnlyKVTransferEngine, the spec's None).
//
// epoch: on the copy a SequenceInfo carries, the owner epoch of that
// sequence's pages (epochs.hpp); engines fail a read of pages that no longer
// carry it with kStaleDescriptor. 0 on the cache's own descriptor
// (get_kv_transfer_info()): such reads are not checked.
//
// page_epochs: the pages of that sequence whose epoch is not `epoch`, with
// their own (sorted by page, each page once, none 0, none equal to
// `epoch`). A sequence that shares pages with an earlier one (prefix
// caching, KVCachePool::adopt with allow_shared) reads those with the epoch
// their content was published under. Empty for an unshared sequence, whose
// bytes are then those of a descriptor without the field. Engines never see
// it: the manager reads each page with its own epoch (with_epoch) and
// hands the engine descriptors without exceptions.
struct KVTransferInfo {
  std::string engine;
  std::vector<std::uint8_t> payload;
  std::uint64_t epoch = 0;
  std::vector<PageEpoch> page_epochs{};

  bool empty() const noexcept { return engine.empty(); }
  // The epoch `page` must carry: its entry in page_epochs, else `epoch`.
  std::uint64_t epoch_of(std::uint32_t page) const noexcept;
  // This descriptor checked against one epoch, without exceptions: what an
  // engine reads one epoch group with.
  KVTransferInfo with_epoch(std::uint64_t e) const;
  std::vector<std::uint8_t> encode() const;
  static KVTransferInfo decode(std::span<const std::uint8_t> bytes);

  bool operator==(const KVTransferInfo&) const = default;
};

// One request as published by the prefill side: entry i of page_indices holds
// tokens [i*page_size, (i+1)*page_size) of the sequence. page_size is the
// owner's layout's (the layout the descriptor describes; KVCachePool::publish
// sets it) and must be in [1, LayoutLimits::kMaxPageSize]; the page count is
// exactly ceil(num_tokens / page_size): decode rejects any other count,
// naming the tokens, the pages and the page size.
//
// lease_expiry_ms: when the prefill side frees the sequence unless a reader
// marked it done first (milliseconds since the Unix epoch, the owner's
// clock; 0 = no lease). Informative for the reader: a pull after expiry
// fails with kStaleDescriptor through the epoch check.
struct SequenceInfo {
  std::uint64_t seq_id = 0;
  std::uint64_t num_tokens = 0;
  std::vector<std::uint32_t> page_indices;
  KVTransferInfo kv_transfer_info;
  std::uint64_t lease_expiry_ms = 0;
  std::uint32_t page_size = 0;  // tokens per page (last: aggregates stay valid)

  std::vector<std::uint8_t> encode() const;
  static SequenceInfo decode(std::span<const std::uint8_t> bytes);

  bool operator==(const SequenceInfo&) const = default;
};

}  // namespace mstar::kv
