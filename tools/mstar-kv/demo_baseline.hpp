// Copyright mstar-kv authors.
//
// The memcpy baseline of `mstar-kv demo`: the same byte spans an engine
// copies, copied by plain threads, to put the engine's time next to what the
// memory itself allows in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "mstar/kv/planner.hpp"

namespace mstar::kv::cli::demo {

// Copies `spans` (offsets from each base, as plan_copies emits them) from src
// to dst with `threads` threads, each taking one contiguous share of the
// bytes. Returns the seconds taken, thread start-up included.
double memcpy_spans(std::byte* dst, const std::byte* src, std::span<const CopySpan> spans,
                    std::uint32_t threads);

}  // namespace mstar::kv::cli::demo
