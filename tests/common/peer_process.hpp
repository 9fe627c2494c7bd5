// Copyright mstar-kv authors.
//
// The conformance suite's peer, kv_conformance_peer, as a test starts it: it
// builds a cache and an engine, fills one sequence with the pattern, prints
// "SEQ <hex SequenceInfo bytes>" and serves until told to quit, its stdin
// closes or it is killed (tests/common/peer.hpp). The destructor kills and
// reaps it.
#pragma once

#include <chrono>
#include <map>
#include <string>

#include "common/layouts.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/factory.hpp"

namespace mstar::kv::testing {

struct PeerSpec {
  std::string engine;  // "shm", "ucx", "mooncake", "cuda_ipc"
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter_seed = 7;            // 0: contiguous pages
  std::map<std::string, std::string> env;    // extra environment for the child
  std::map<std::string, std::string> extra;  // EngineOptions.extra
  long long lease_ms = -1;                   // >= 0: the pool's lease
  // The owner's cache: the loopback setup's (make_loopback_cache).
  LoopbackSetup setup;
};

// Starts kv_conformance_peer with `spec` and waits (up to `timeout`) for its
// SequenceInfo. Throws std::runtime_error with the peer's message on failure.
class PeerProcess : public Peer {
 public:
  explicit PeerProcess(const PeerSpec& spec,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30));
};

}  // namespace mstar::kv::testing
