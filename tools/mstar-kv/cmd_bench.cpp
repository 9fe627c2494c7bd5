// Copyright mstar-kv authors.
//
// `mstar-kv bench`: every built engine against the physical limit, the
// fastest copy of the same spans this machine makes, in one run
// (bench_driver.hpp). The transports' own best and the peers are the
// development benchmark's (bench/mstar-kv-bench, not installed). See
// bench/README.md for the commands and the latest numbers.
#include "bench_driver.hpp"
#include "commands.hpp"

namespace mstar::kv::cli {

namespace {

const char* kHeader =
    "usage: mstar-kv bench [options]\n"
    "\n"
    "Measures every built engine (local, shm, ucx over tcp and sm, mooncake, cuda_ipc)\n"
    "on KV workloads from real models and on raw piece/batch sweeps, each beside its\n"
    "baseline measured in the same run: the fastest copy of the same copy spans\n"
    "(memcpy or non-temporal stores, on each thread count up to the cores, threads\n"
    "started and pages touched before timing). The transports' own best and the\n"
    "peers (ucx_perftest, iperf3, Mooncake's transfer_engine_bench, NIXL) are\n"
    "measured by the development benchmark bench/mstar-kv-bench of a source build;\n"
    "the Python package by bench/python_bench.py (see bench/README.md).\n"
    "With no options: the default suite (under two minutes on 2 cores).\n";

}  // namespace

int cmd_bench(int argc, char** argv) {
  bench::BenchExtension ext;
  ext.help_header = kHeader;
  ext.serve_argv = {"bench"};
  return bench::bench_main(argc, argv, ext);
}

}  // namespace mstar::kv::cli
