// Copyright mstar-kv authors.
//
// External references run by `mstar-kv-bench` in the same run as the
// engines: ucx_perftest (the UCX transport's own best), iperf3 (raw TCP on
// loopback), Mooncake's transfer_engine_bench and NIXL (the peers). Each run is
// bounded in time and its processes are always killed; a tool that is
// missing or fails gives ok = false and the reason. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace mstar::kv::cli::bench {

struct ExternalResult {
  bool ok = false;
  double gbps = 0;      // 1e9 bytes per second
  std::string error;    // why not ok
  std::string command;  // what was run (client side)
};

// `ucx_perftest 127.0.0.1 -p PORT -t TEST -s SIZE -n ITERS` against a server
// on loopback, both with UCX_TLS=tls and UCX_NET_DEVICES=lo. TEST is
// "stream_bw" or "tag_bw".
ExternalResult run_ucx_perftest(const std::string& tls, const std::string& test,
                                std::uint64_t message_bytes);

// iperf3 client against a server, both on 127.0.0.1, for `seconds`, one
// stream of write_bytes writes.
ExternalResult run_iperf3(double seconds, std::uint64_t write_bytes);

// Where transfer_engine_bench is: $MSTAR_KV_MOONCAKE_BENCH, else the one
// inside the installed `mooncake` Python package; "" and the reason when
// Mooncake is not installed.
std::string find_mooncake_bench(std::string* why_not);

// Mooncake's transfer_engine_bench over TCP on loopback with its P2P
// handshake: a target process, then an initiator reading block_bytes x
// batch for `seconds` on `threads` threads.
ExternalResult run_mooncake_bench(const std::string& binary, std::uint64_t block_bytes,
                                  std::uint32_t batch, std::uint32_t threads, int seconds);

// NVIDIA NIXL's READ of `count` scattered blocks of `block` bytes between
// two processes on loopback (nixl_peer.py beside this file; PyPI's nixl-cu12 wheel,
// UCX backend with UCX_TLS=tls, DRAM), the descriptors prepared once and the
// transfer re-posted `iters` times, the bytes of the last one verified.
// Not ok, with the reason, when python3 or NIXL is missing or it fails.
ExternalResult run_nixl_peer(const std::string& tls, std::uint64_t block, std::uint32_t count,
                             std::uint32_t iters);

}  // namespace mstar::kv::cli::bench
