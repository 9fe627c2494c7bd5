// Copyright mstar-kv authors.
//
// Helpers shared by the libFuzzer targets.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "core/codec.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::fuzz {

// Prints why and aborts, so that libFuzzer records the input as a crash.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::abort();
}

inline void require(bool ok, const char* what) {
  if (!ok) fail(what);
}

// Frames carry a CRC-32C, which random mutations almost never get right. So
// that the decoders behind the frame check get fuzzed too, an input whose
// first byte is odd is treated as "the rest, with a correct CRC": the last 4
// bytes are replaced by the CRC of everything before them.
inline std::vector<std::uint8_t> frame_input(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return {};
  std::vector<std::uint8_t> bytes(data + 1, data + size);
  if ((data[0] & 1) != 0 && bytes.size() >= 4) {
    const std::uint32_t crc =
        codec::crc32c(std::span<const std::uint8_t>(bytes.data(), bytes.size() - 4));
    for (int i = 0; i < 4; ++i) {
      bytes[bytes.size() - 4 + static_cast<std::size_t>(i)] =
          static_cast<std::uint8_t>(crc >> (8 * i));
    }
  }
  return bytes;
}

// The value `decode()` returns from untrusted bytes, or nullopt when it
// threw Error(kCorruptDescriptor); any other code is a violation (and any
// other exception a crash).
template <typename Decode>
auto decoded(Decode&& decode) -> std::optional<decltype(decode())> {
  try {
    return decode();
  } catch (const Error& e) {
    require(e.code() == StatusCode::kCorruptDescriptor, "decode threw a non-corrupt code");
    return std::nullopt;
  }
}

// The input as the payload of a descriptor of `engine`.
inline KVTransferInfo payload(const char* engine, const std::uint8_t* data, std::size_t size) {
  return KVTransferInfo{engine, std::vector<std::uint8_t>(data, data + size)};
}

// A decoded RMA region (ucx, mooncake): it fits its layout, does not wrap
// the address space, and encodes back to the payload it came from.
template <typename Region>
void require_region(const Region& r, const KVTransferInfo& from) {
  require(r.generation != 0 && r.data_ptr != 0, "zero generation or address accepted");
  require(r.data_ptr + r.size >= r.data_ptr, "region wraps the address space");
  require(r.layout.total_bytes() <= r.size, "layout larger than the region accepted");
  r.layout.validate();
  require(r.encode() == from, "decode(payload) does not encode back to it");
}

// A region descriptor's decoder (Region::decode: ucx, mooncake) on an
// untrusted payload of `engine`: it throws Error(kCorruptDescriptor) or
// returns a region require_region accepts. The whole of such a fuzz target.
template <typename Region>
int fuzz_region_decoder(const char* engine, const std::uint8_t* data, std::size_t size) {
  const KVTransferInfo info = payload(engine, data, size);
  const auto r = decoded([&] { return Region::decode(info); });
  if (r) require_region(*r, info);
  return 0;
}

// A decoded KVTransferInfo (alone or inside a SequenceInfo) within the
// descriptor limits; a local-only one carries no epoch (nothing could check
// it); page_epochs name ascending pages once, each with an epoch neither 0
// nor the descriptor's own, on a descriptor with an epoch.
inline void require_transfer_info(const KVTransferInfo& info) {
  require(info.engine.size() <= DescriptorLimits::kMaxEngineName, "engine name limit");
  require(info.payload.size() <= DescriptorLimits::kMaxTransferPayload, "payload limit");
  require(!info.empty() || info.epoch == 0, "local-only descriptor with an epoch");
  const auto& pe = info.page_epochs;
  for (std::size_t i = 0; i < pe.size(); ++i) {
    require(pe[i].epoch != 0 && pe[i].epoch != info.epoch, "page_epochs epoch");
    require(i == 0 || pe[i - 1].page < pe[i].page, "page_epochs order");
  }
  require(pe.empty() || info.epoch != 0, "page_epochs without an epoch");
}

}  // namespace mstar::kv::fuzz
