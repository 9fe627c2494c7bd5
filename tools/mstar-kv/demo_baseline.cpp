// Copyright mstar-kv authors.
#include "demo_baseline.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace mstar::kv::cli::demo {

double memcpy_spans(std::byte* dst, const std::byte* src, std::span<const CopySpan> spans,
                    std::uint32_t threads) {
  threads = std::max<std::uint32_t>(threads, 1);
  std::uint64_t total = 0;
  for (const CopySpan& s : spans) total += s.length;
  // Thread t copies bytes [t*total/threads, (t+1)*total/threads) of the
  // concatenated spans.
  auto run = [&](std::uint32_t t) {
    const std::uint64_t lo = total * t / threads;
    const std::uint64_t hi = total * (t + 1) / threads;
    std::uint64_t pos = 0;
    for (const CopySpan& s : spans) {
      const std::uint64_t a = std::max(lo, pos);
      const std::uint64_t b = std::min(hi, pos + s.length);
      if (a < b) {
        std::memcpy(dst + s.local_offset + (a - pos), src + s.remote_offset + (a - pos), b - a);
      }
      pos += s.length;
      if (pos >= hi) break;
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (std::uint32_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mstar::kv::cli::demo
