// Copyright mstar-kv authors.
//
// Invariant checks shared by the reliability tests (and usable by any engine
// test): after a read resolves, whatever its outcome,
// * no byte outside the read's destination spans changed;
// * after a failed, cancelled or timed-out read, no byte changes after the
//   future resolved (snapshot at resolution vs. after a grace period);
// * the future resolved within its deadline;
// * nothing is left in /dev/shm and no file descriptor leaked.
// Host caches only. Not thread-safe: one checker per read.
#pragma once

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/future.hpp"
#include "mstar/kv/planner.hpp"
#include "mstar/kv/read_info.hpp"

namespace mstar::kv::testing {

// Fills the whole cache with a sentinel sequence (not the KV pattern, so a
// sentinel never verifies as data and data never looks like the sentinel).
inline void fill_sentinel(const KVCache& cache, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  std::byte* p = cache.base();
  const std::size_t n = cache.size_bytes();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = std::byte{0xA5};
}

inline std::vector<std::byte> snapshot(const KVCache& cache) {
  return {cache.base(), cache.base() + cache.size_bytes()};
}

// The local byte ranges a read may write: its copy plan's local spans,
// sorted and merged.
inline std::vector<std::pair<std::uint64_t, std::uint64_t>> allowed_ranges(
    const KVLayout& local, const KVLayout& remote, std::span<const KVReadInfo> reads) {
  const CopyPlan plan = plan_copies(local, remote, reads);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> r;
  r.reserve(plan.spans.size());
  for (const CopySpan& s : plan.spans) r.emplace_back(s.local_offset, s.local_offset + s.length);
  std::sort(r.begin(), r.end());
  std::vector<std::pair<std::uint64_t, std::uint64_t>> merged;
  for (const auto& [b, e] : r) {
    if (!merged.empty() && b <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, e);
    } else {
      merged.emplace_back(b, e);
    }
  }
  return merged;
}

// First byte outside `allowed` where `now` differs from `before`; nullopt
// when none.
inline std::optional<std::uint64_t> changed_outside(
    std::span<const std::byte> before, const KVCache& now,
    const std::vector<std::pair<std::uint64_t, std::uint64_t>>& allowed) {
  const std::byte* p = now.base();
  std::uint64_t pos = 0;
  auto check = [&](std::uint64_t from, std::uint64_t to) -> std::optional<std::uint64_t> {
    if (from >= to) return std::nullopt;
    if (std::memcmp(before.data() + from, p + from, to - from) == 0) return std::nullopt;
    for (std::uint64_t i = from; i < to; ++i) {
      if (before[i] != p[i]) return i;
    }
    return std::nullopt;
  };
  for (const auto& [b, e] : allowed) {
    if (auto at = check(pos, b)) return at;
    pos = e;
  }
  return check(pos, before.size());
}

// First byte where the cache differs from `snap`; nullopt when none.
inline std::optional<std::uint64_t> changed_since(std::span<const std::byte> snap,
                                                  const KVCache& now) {
  if (std::memcmp(snap.data(), now.base(), snap.size()) == 0) return std::nullopt;
  for (std::uint64_t i = 0; i < snap.size(); ++i) {
    if (snap[i] != now.base()[i]) return i;
  }
  return std::nullopt;
}

// Watches one read into `cache`: construct before issuing it (fills the
// sentinel), then call check() with its future. Returns "" when every
// invariant holds, else what broke.
class ReadChecker {
 public:
  ReadChecker(const KVCache& cache, const KVLayout& remote, std::span<const KVReadInfo> reads,
              std::uint64_t sentinel_seed = 1)
      : cache_(cache), allowed_(allowed_ranges(cache.layout(), remote, reads)) {
    fill_sentinel(cache, sentinel_seed);
    before_ = snapshot(cache);
  }

  // Waits up to `deadline` for the future; then, for a failed read, checks
  // that nothing changes for `grace`; always checks that nothing outside the
  // read's spans changed.
  std::string check(const TransferFuture& f, std::chrono::milliseconds deadline,
                    std::chrono::milliseconds grace = std::chrono::milliseconds(200)) {
    if (!f.wait_for(deadline)) {
      return "future did not resolve within " + std::to_string(deadline.count()) + " ms";
    }
    status_ = f.status();
    if (!status_.is_ok()) {
      const std::vector<std::byte> at_resolution = snapshot(cache_);
      std::this_thread::sleep_for(grace);
      if (auto at = changed_since(at_resolution, cache_)) {
        return "byte " + std::to_string(*at) + " changed after the future resolved with " +
               status_.to_string();
      }
    }
    if (auto at = changed_outside(before_, cache_, allowed_)) {
      return "byte " + std::to_string(*at) + " outside the read's destination spans changed";
    }
    return "";
  }

  // First byte outside `subset`'s spans that differs from the sentinel
  // (e.g. to check that "fail after N bytes" wrote no more than its prefix).
  std::optional<std::uint64_t> changed_outside_of(const KVLayout& remote,
                                                  std::span<const KVReadInfo> subset) const {
    if (subset.empty()) return changed_since(before_, cache_);
    return changed_outside(before_, cache_, allowed_ranges(cache_.layout(), remote, subset));
  }

  const Status& status() const { return status_; }
  // True when no byte of the destination spans changed (a read that never
  // started).
  bool destination_untouched() const {
    return !changed_since(before_, cache_).has_value();
  }

 private:
  const KVCache& cache_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> allowed_;
  std::vector<std::byte> before_;
  Status status_;
};

// Names in /dev/shm and the number of open file descriptors of this process,
// to compare before and after.
struct ResourceSnapshot {
  std::set<std::string> shm;
  std::size_t fds = 0;

  static ResourceSnapshot take() {
    ResourceSnapshot s;
    s.shm = list_dir("/dev/shm");
    s.fds = list_dir("/proc/self/fd").size();
    return s;
  }

  // "" when no /dev/shm entry was added and no descriptor leaked (entries
  // others created at the same time would show up too: tests that run in
  // parallel filter by their own prefix).
  std::string leaks_since(const ResourceSnapshot& before, const std::string& prefix = "") const {
    std::string out;
    for (const auto& n : shm) {
      if (before.shm.count(n) == 0 && n.rfind(prefix, 0) == 0) out += " /dev/shm/" + n;
    }
    if (fds > before.fds) {
      out += " " + std::to_string(fds - before.fds) + " more open file descriptors";
    }
    return out;
  }

 private:
  static std::set<std::string> list_dir(const char* path) {
    std::set<std::string> names;
    if (DIR* d = ::opendir(path)) {
      while (dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          names.insert(e->d_name);
        }
      }
      ::closedir(d);
    }
    return names;
  }
};

}  // namespace mstar::kv::testing
