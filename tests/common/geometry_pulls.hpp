// Copyright mstar-kv authors.
//
// Pulls between caches of different geometry (layout.hpp, planner.hpp), as
// the engine suites and the cuda_ipc kernel tests check them (the cases:
// geometry_cases() in layouts.hpp): byte-exact by the pattern, keyed by
// model head and token position; bytes the read does not name keep the
// sentinel.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

// Every byte of `local` outside the destination spans of `reads` (planned
// against `remote`) still holds `sentinel`.
inline void expect_only_named_bytes_written(const KVCache& local, const KVLayout& remote,
                                            std::span<const KVReadInfo> reads, std::byte sentinel) {
  EXPECT_EQ(bytes_written_outside(local, remote, reads, sentinel), 0u)
      << "bytes outside the read were written";
}

// Tokens [c.start, end) of `seq` (a sequence of `remote`) pulled through `m`
// into `cache` (of c.local, every byte `sentinel`), onto local pages spread
// over it: byte-exact by the pattern of `seed`, nothing else written.
inline void expect_geometry_pull(KVTransferManager& m, const KVCache& cache, const GeometryCase& c,
                                 const KVLayout& remote, const SequenceInfo& seq, std::uint64_t end,
                                 std::uint64_t seed, std::byte sentinel) {
  const std::size_t n = (end + c.local.page_size - 1) / c.local.page_size;
  std::vector<std::uint32_t> lp(n);
  for (std::size_t i = 0; i < n; ++i) {
    lp[i] = static_cast<std::uint32_t>((i * 3 + 1) % c.local.num_pages);
  }
  m.sync_retrieve(c.start, end, lp, seq.page_indices, seq.kv_transfer_info);
  auto v = verify_pattern_any(cache, seed, lp, c.start, end);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(
      cache, remote, plan_reads(c.local, remote, c.start, end, lp, seq.page_indices), sentinel);
}

}  // namespace mstar::kv::testing
