// Copyright mstar-kv authors.
//
// Plain TCP on loopback beside the `mstar-kv-bench` cases that cross a TCP
// socket, measured in the same run: a small request against one round trip
// carrying its bytes, a large one against one stream carrying its bytes
// from and into memory of its size. Not thread-safe.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "bench_report.hpp"

namespace mstar::kv::cli::bench {

// The latency floor of a small request: one TCP round trip on loopback that
// carries `reply_bytes` back (a 1-byte request, the reply read whole;
// TCP_NODELAY both ways), two threads of this process, `iters` trips after
// 10 of warm-up. gbps holds nothing; p50_us the median trip.
struct RttResult {
  bool ok = false;
  double p50_us = 0;
  std::string error;
};
RttResult run_tcp_round_trip(std::uint64_t reply_bytes, std::uint32_t iters);

// One TCP stream on loopback (two threads of this process, 1 MiB writes)
// carrying `bytes` from a buffer of that size into another, `reps` times;
// the median GB/s. Unlike iperf3, which re-sends one cache-hot buffer, its
// bytes come from and land in memory as large as a request's.
struct StreamResult {
  bool ok = false;
  double gbps = 0;
  std::string error;
};
StreamResult run_tcp_stream(std::uint64_t bytes, std::uint32_t reps);

// For every measured case of a variant in `over_tcp`: requests of at most
// 8 MiB get a note of their p50 against one round trip of their bytes,
// larger ones a note of their GB/s against one stream of their bytes (and
// extra["tcp_stream_same_bytes"]).
void note_tcp_floors(Report& report, const std::set<std::string>& over_tcp, Progress& progress);

}  // namespace mstar::kv::cli::bench
