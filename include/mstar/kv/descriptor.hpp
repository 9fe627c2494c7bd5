// Copyright mstar-kv authors.
//
// Descriptors: what one process tells another so that it can read its cache.
// Both types serialise to versioned, self-describing, checksummed bytes
// ("MSKV" frame). Decoding treats the bytes as untrusted input: truncated,
// oversized, wrong-version, corrupted or inconsistent bytes throw
// Error(kCorruptDescriptor) naming the field, never crash or over-read.
#pragma once

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

// An engine's descriptor of its cache, opaque outside that engine: the
// engine's name ("shm", "ucx", "mooncake", "cuda_ipc") plus the payload that
// engine encoded. An empty engine name stands for "no transfer engine"
// (LocalOnlyKVTransferEngine, the spec's None).
struct KVTransferInfo {
  std::string engine;
  std::vector<std::uint8_t> payload;

  bool empty() const noexcept { return engine.empty(); }
  std::vector<std::uint8_t> encode() const;
  static KVTransferInfo decode(std::span<const std::uint8_t> bytes);

  bool operator==(const KVTransferInfo&) const = default;
};

// One request as published by the prefill side: entry i of page_indices holds
// tokens [i*page_size, (i+1)*page_size) of the sequence.
struct SequenceInfo {
  std::uint64_t seq_id = 0;
  std::uint64_t num_tokens = 0;
  std::vector<std::uint32_t> page_indices;
  KVTransferInfo kv_transfer_info;

  std::vector<std::uint8_t> encode() const;
  static SequenceInfo decode(std::span<const std::uint8_t> bytes);

  bool operator==(const SequenceInfo&) const = default;
};

}  // namespace mstar::kv
