// Copyright mstar-kv authors.
//
// Child processes for `mstar-kv bench`: the benchmark's server processes
// (the remote side of a same-host or loopback transfer), and in the
// development benchmark (bench/mstar-kv-bench) the external baselines
// (ucx_perftest, iperf3, Mooncake's transfer_engine_bench, NIXL).
//
// Every child runs in its own process group, dies with the parent
// (PR_SET_PDEATHSIG) and is bounded in time: Child's destructor kills the
// whole group (SIGTERM, then SIGKILL) and reaps it (src/toolkit/child.hpp).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "toolkit/child.hpp"

namespace mstar::kv::cli::bench {

// Bench children (toolkit::Child) run in their own process group, so that
// the kills reach the helpers they start, and get 2 s to exit on SIGTERM.
struct SpawnOptions : toolkit::ChildOptions {
  SpawnOptions() {
    own_group = true;
    destroy_grace = std::chrono::milliseconds(2000);
  }
};
using toolkit::Child;

// The whole file, or "" when it cannot be read.
std::string read_file(const std::string& path);
// A fresh temporary file name under $TMPDIR (or /tmp); the file exists.
std::string temp_file(const std::string& stem);
// The last `n` non-empty lines of `text` joined by " | ", at most 400 chars.
std::string last_lines(const std::string& text, int n);

// Blocking I/O on pipes, with a deadline; false on EOF, error or timeout.
bool write_all(int fd, const void* data, std::size_t n);
bool read_exact(int fd, void* data, std::size_t n, std::chrono::milliseconds timeout);

}  // namespace mstar::kv::cli::bench
