// Copyright mstar-kv authors.
//
// The read checker of the soak and the reliability tests: after a read
// resolves, whatever its outcome,
// * no byte outside the read's destination spans changed;
// * after a failed, cancelled or timed-out read, no byte changes after the
//   future resolved (a copy at resolution vs. one after a grace period);
// * the future resolved within its deadline.
// Host-readable caches only. Not thread-safe: one checker per read.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/core/read_info.hpp"

namespace mstar::kv::toolkit {

// Byte ranges [begin, end) of a cache.
using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

// Sorted, overlapping and touching ranges merged.
Ranges merged(Ranges r);
// The local byte ranges a read may write: its copy plan's local spans.
Ranges allowed_ranges(const KVLayout& local, const KVLayout& remote,
                      std::span<const KVReadInfo> reads);
// The bytes of `pages` (every layer, k and v).
Ranges page_ranges(const KVLayout& l, std::span<const std::uint32_t> pages);

// Fills `ranges` with a sentinel sequence of `seed` (not the KV pattern: a
// sentinel never verifies as data and data never looks like it).
void fill_sentinel(const KVCache& c, const Ranges& ranges, std::uint64_t seed);
// A copy of the bytes of `ranges`, one after another.
std::vector<std::byte> save(const KVCache& c, const Ranges& ranges);
// The first offset inside `ranges` but outside `allowed` (merged) where the
// cache differs from `saved` (save() of `ranges`); nullopt when none.
std::optional<std::uint64_t> changed(const KVCache& c, const Ranges& ranges,
                                     std::span<const std::byte> saved, const Ranges& allowed = {});

// Watches one read into `cache`: construct it before issuing the read (it
// fills the watched bytes with the sentinel and keeps a copy), then call
// check() with the read's future.
class ReadChecker {
 public:
  // The read may write `allowed`; `watched` (the whole cache when empty)
  // are the bytes checked.
  ReadChecker(const KVCache& cache, Ranges allowed, std::uint64_t sentinel_seed = 1,
              Ranges watched = {});
  // The read of `reads` from a cache of layout `remote`.
  ReadChecker(const KVCache& cache, const KVLayout& remote, std::span<const KVReadInfo> reads,
              std::uint64_t sentinel_seed = 1);

  // Waits up to `deadline` for the future; then, for a failed read, checks
  // that nothing changes for `grace`; always checks that nothing outside the
  // read's spans changed. "" when every invariant holds, else what broke.
  std::string check(const TransferFuture& f, std::chrono::milliseconds deadline,
                    std::chrono::milliseconds grace = std::chrono::milliseconds(200));

  // First watched byte outside `subset`'s spans that differs from the
  // sentinel (e.g. "fail after N bytes" wrote no more than its prefix).
  std::optional<std::uint64_t> changed_outside_of(const KVLayout& remote,
                                                  std::span<const KVReadInfo> subset) const;
  // True when no watched byte changed (a read that never started).
  bool destination_untouched() const;
  // The status check() saw.
  const Status& status() const noexcept { return status_; }

 private:
  const KVCache& cache_;
  Ranges watched_;
  Ranges allowed_;
  std::vector<std::byte> before_;
  Status status_;
};

}  // namespace mstar::kv::toolkit
