// Copyright mstar-kv authors.
#include "toolkit/read_check.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "mstar/kv/core/planner.hpp"

namespace mstar::kv::toolkit {

Ranges merged(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [b, e] : r) {
    if (!out.empty() && b <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}

Ranges allowed_ranges(const KVLayout& local, const KVLayout& remote,
                      std::span<const KVReadInfo> reads) {
  Ranges r;
  if (reads.empty()) return r;
  const CopyPlan plan = plan_copies(local, remote, reads);
  r.reserve(plan.spans.size());
  for (const CopySpan& s : plan.spans) r.emplace_back(s.local_offset, s.local_offset + s.length);
  return merged(std::move(r));
}

Ranges page_ranges(const KVLayout& l, std::span<const std::uint32_t> pages) {
  Ranges r;
  for (std::uint32_t p : pages) {
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
        const std::uint64_t off = l.block_offset(layer, static_cast<KV>(kv), p);
        r.emplace_back(off, off + l.block_bytes());
      }
    }
  }
  return merged(std::move(r));
}

// Ranges are walked region by region (caches of one region per layer).
void fill_sentinel(const KVCache& c, const Ranges& ranges, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  for (const auto& [b, e] : ranges) {
    c.for_each_run(b, e - b, [&](std::byte* p, std::uint64_t, std::uint64_t n) {
      std::uint64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::memcpy(p + i, &x, 8);
      }
      for (; i < n; ++i) p[i] = std::byte{0xA5};
    });
  }
}

std::vector<std::byte> save(const KVCache& c, const Ranges& ranges) {
  std::vector<std::byte> out;
  for (const auto& [b, e] : ranges) {
    c.for_each_run(b, e - b, [&](std::byte* p, std::uint64_t, std::uint64_t n) {
      out.insert(out.end(), p, p + n);
    });
  }
  return out;
}

std::optional<std::uint64_t> changed(const KVCache& c, const Ranges& ranges,
                                     std::span<const std::byte> saved, const Ranges& allowed) {
  std::size_t pos = 0;  // of the current range in `saved`
  std::size_t a = 0;    // the first allowed range that may still matter
  for (const auto& range : ranges) {
    // Not a structured binding: clang 14 (the thread-safety build's) cannot
    // capture one in the lambda below.
    const std::uint64_t b = range.first;
    const std::uint64_t e = range.second;
    std::uint64_t x = b;
    while (x < e) {
      while (a < allowed.size() && allowed[a].second <= x) ++a;
      if (a < allowed.size() && allowed[a].first <= x) {
        x = std::min(e, allowed[a].second);  // skip the allowed part
        continue;
      }
      const std::uint64_t stop = a < allowed.size() ? std::min(e, allowed[a].first) : e;
      std::optional<std::uint64_t> found;
      c.for_each_run(x, stop - x, [&](std::byte* now, std::uint64_t off, std::uint64_t n) {
        const std::byte* was = saved.data() + pos + (off - b);
        if (found || std::memcmp(now, was, n) == 0) return;
        for (std::uint64_t i = 0; i < n; ++i) {
          if (now[i] != was[i]) {
            found = off + i;
            return;
          }
        }
      });
      if (found) return found;
      x = stop;
    }
    pos += e - b;
  }
  return std::nullopt;
}

ReadChecker::ReadChecker(const KVCache& cache, Ranges allowed, std::uint64_t sentinel_seed,
                         Ranges watched)
    : cache_(cache),
      watched_(watched.empty() ? Ranges{{0, cache.size_bytes()}} : std::move(watched)),
      allowed_(std::move(allowed)) {
  fill_sentinel(cache_, watched_, sentinel_seed);
  before_ = save(cache_, watched_);
}

ReadChecker::ReadChecker(const KVCache& cache, const KVLayout& remote,
                         std::span<const KVReadInfo> reads, std::uint64_t sentinel_seed)
    : ReadChecker(cache, allowed_ranges(cache.layout(), remote, reads), sentinel_seed) {}

std::string ReadChecker::check(const TransferFuture& f, std::chrono::milliseconds deadline,
                               std::chrono::milliseconds grace) {
  if (!f.wait_for(deadline)) {
    return "future did not resolve within " + std::to_string(deadline.count()) + " ms";
  }
  status_ = f.status();
  if (!status_.is_ok()) {
    const std::vector<std::byte> at_resolution = save(cache_, watched_);
    std::this_thread::sleep_for(grace);
    if (auto at = changed(cache_, watched_, at_resolution)) {
      return "byte " + std::to_string(*at) + " changed after the future resolved with " +
             status_.to_string();
    }
  }
  if (auto at = changed(cache_, watched_, before_, allowed_)) {
    return "byte " + std::to_string(*at) + " outside the read's destination spans changed";
  }
  return "";
}

std::optional<std::uint64_t> ReadChecker::changed_outside_of(
    const KVLayout& remote, std::span<const KVReadInfo> subset) const {
  return changed(cache_, watched_, before_, allowed_ranges(cache_.layout(), remote, subset));
}

bool ReadChecker::destination_untouched() const {
  return !changed(cache_, watched_, before_).has_value();
}

}  // namespace mstar::kv::toolkit
