// Copyright mstar-kv authors.
//
// The server process behind a remote engine variant of `mstar-kv bench`: it
// owns the remote cache, publishes sequences over it on request and serves
// reads through its engine (`mstar-kv bench --internal-serve ...`, or
// `mstar-kv-bench --internal-serve ...`, started by run_case through Server). The two talk over a
// pair of pipes: framed replies, 'K' + bytes or 'E' + status code + message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_proc.hpp"
#include "bench_run.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::cli::bench {

// The seed every bench cache is filled with (fill_pattern / verify_pattern).
inline constexpr std::uint64_t kFillSeed = 0xbe9c0ffee;

// Bytes the host can read and write (fill, verify, memcpy baseline).
inline bool host_accessible(MemoryKind k) { return k != MemoryKind::kDevice; }

// The remote side of a case, in its own process.
class Server {
 public:
  // Starts the server and waits for its descriptor. The server's stdout and
  // stderr (engine logs) go to a temporary file, quoted in errors and
  // removed afterwards. Throws Error (the server's own code when it refused).
  Server(const EngineVariant& v, const Workload& w, const RunOptions& o);
  // Closes the command pipe (the server shuts its engine down and exits).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Fills `pages` of the remote cache with the pattern (kFillSeed) and
  // publishes them as sequence seq_id of `tokens` tokens.
  SequenceInfo publish(std::uint64_t seq_id, std::uint64_t tokens,
                       const std::vector<std::uint32_t>& pages);

 private:
  // Removes the log file however the server ends, also when the
  // constructor throws (then ~Server does not run, but members are destroyed).
  struct LogFile {
    std::string path;
    explicit LogFile(std::string p) : path(std::move(p)) {}
    ~LogFile();
    LogFile(const LogFile&) = delete;
    LogFile& operator=(const LogFile&) = delete;
  };
  LogFile log_;  // declared before child_: the child is reaped first
  Child child_;
};

// The server's main (RunOptions::serve_argv, then `--internal-serve ENGINE
// KIND LAYOUT THREADS TIMEOUT_MS EXTRA REGIONS`): the arguments after
// --internal-serve.
int serve_main(int argc, char** argv);

}  // namespace mstar::kv::cli::bench
