// Copyright mstar-kv authors.
//
// Helpers shared by the libFuzzer targets.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "core/codec.hpp"

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

}  // namespace mstar::kv::fuzz
