// Copyright mstar-kv authors.
//
// A real peer process for engine tests: fork/exec of kv_conformance_peer,
// which builds a cache and an engine, fills one sequence with the pattern,
// prints "SEQ <hex SequenceInfo bytes>" and serves until told to quit, its
// stdin closes or it is killed. The destructor kills and reaps it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "common/child_process.hpp"
#include "common/wire.hpp"
#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/layout.hpp"

namespace mstar::kv::testing {

struct PeerSpec {
  std::string engine;          // "shm", "ucx", "mooncake"
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter_seed = 7;  // 0: contiguous pages
  std::map<std::string, std::string> env;    // extra environment for the child
  std::map<std::string, std::string> extra;  // EngineOptions.extra
  long long lease_ms = -1;                   // >= 0: the pool's lease
};


class PeerProcess {
 public:
  // Starts the peer and waits (up to `timeout`) for its SequenceInfo.
  // Throws std::runtime_error with the peer's message on failure.
  explicit PeerProcess(const PeerSpec& spec,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30));
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  const SequenceInfo& sequence() const { return seq_; }
  // A line to the peer (e.g. "next 20"), and the next "SEQ" it prints (the
  // new current sequence) or another line it answers.
  void send(const std::string& line) { child_.write_line(line); }
  const SequenceInfo& read_sequence(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    return child_.read_line(timeout);
  }
  pid_t pid() const { return child_.pid(); }
  // SIGKILL and reap.
  void kill_now();
  // Asks it to quit and reaps it.
  void quit();

 private:
  Child child_;  // its destructor kills and reaps the peer
  SequenceInfo seq_;
};

}  // namespace mstar::kv::testing
