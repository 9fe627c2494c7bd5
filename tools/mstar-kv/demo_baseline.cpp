// Copyright mstar-kv authors.
#include "demo_baseline.hpp"

#include <algorithm>
#include <chrono>

#include "testkit/span_copy.hpp"

namespace mstar::kv::cli::demo {

double memcpy_spans(std::byte* dst, const std::byte* src, std::span<const CopySpan> spans,
                    std::uint32_t threads) {
  threads = std::max<std::uint32_t>(threads, 1);
  // Starting and joining the threads is part of the baseline's time, as a
  // one-off copy pays it.
  const auto t0 = std::chrono::steady_clock::now();
  {
    testkit::SpanCopyPool pool(threads);
    pool.run(testkit::partition(spans, threads), dst, src);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mstar::kv::cli::demo
