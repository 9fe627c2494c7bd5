// Copyright mstar-kv authors.
//
// Peer processes of the multi-process tests, both sides.
//
// A peer (kv_conformance_peer, shm_peer, cuda_ipc_owner,
// mooncake_shared_peer) owns a cache, publishes sequences as "SEQ <hex>"
// lines on its stdout (src/toolkit/seq_line.hpp), takes commands one a line
// on its stdin and prints "ERR <message>" and exits 1 when it fails.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/manager.hpp"
#include "toolkit/child.hpp"

namespace mstar::kv::testing {

using toolkit::Child;

// ---- the test's side ----------------------------------------------------------

// A running peer. Its stderr stays the test's (UCX, Mooncake and CUDA log
// there); its stdout is read. The destructor kills and reaps it.
class Peer {
 public:
  // Starts argv (env added) and waits up to `timeout` for its first
  // sequence. Throws std::runtime_error with the peer's message on failure.
  Peer(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
       std::chrono::milliseconds timeout = std::chrono::seconds(30));
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  const SequenceInfo& sequence() const { return seq_; }
  // A command line to the peer (e.g. "next 20").
  void send(const std::string& line) { child_.write_line(line); }
  // The next line must be a "SEQ": the new current sequence. Throws
  // std::runtime_error naming any other line.
  const SequenceInfo& read_sequence(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // The next "SEQ" line, skipping other lines; throws on "ERR", EOF or the
  // timeout (and kills the peer).
  const SequenceInfo& await_sequence(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // send(line), then await_sequence().
  const SequenceInfo& command(const std::string& line,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    send(line);
    return await_sequence(timeout);
  }
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    return child_.read_line(timeout);
  }
  pid_t pid() const { return child_.pid(); }
  Child& child() { return child_; }
  // SIGKILL and reap.
  void kill_now() { child_.kill_now(); }
  // Asks it to quit and reaps it (SIGKILL after 2 s).
  void quit();

 private:
  Child child_;
  SequenceInfo seq_;
};

// What a reader keeps of a peer once the peer is dead: its descriptor and
// page table. read_then_kill reads `tokens` tokens of the peer's sequence
// into `local_pages` through `m` (so that the engine caches whatever it
// caches per peer), then SIGKILLs the peer.
struct DeadPeer {
  KVTransferInfo descriptor;
  std::vector<std::uint32_t> pages;
};
DeadPeer read_then_kill(Peer& peer, KVTransferManager& m, std::uint64_t tokens,
                        const std::vector<std::uint32_t>& local_pages);

// ---- the peer's side ------------------------------------------------------------

// The arguments every peer takes, "--key value" each: --engine, --layout
// (layout_arg), --tokens, --seed, --scatter, --lease-ms, --extra k=v
// (repeatable, EngineOptions.extra). Other pairs are kept in `other`; names
// in `flags` are taken without a value.
struct PeerArgs {
  std::string engine;
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter = 0;
  std::optional<std::chrono::milliseconds> lease;
  EngineOptions options;
  std::map<std::string, std::string> other;
  std::set<std::string> flags;  // those of `flags` that were given
};
// Throws std::runtime_error or Error (a bad layout).
PeerArgs parse_peer_args(int argc, char** argv, const std::set<std::string>& flags = {});

// Runs a peer's main: an exception prints "ERR <its message on one line>"
// and returns 1; else body's result.
int run_peer(const std::function<int()>& body);
// One line on stdout, flushed; safe from any thread.
void say(const std::string& line);
// "SEQ <hex>" of `seq`, said.
void say_sequence(const SequenceInfo& seq);

}  // namespace mstar::kv::testing
