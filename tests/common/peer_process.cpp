// Copyright mstar-kv authors.
#include "common/peer_process.hpp"

#include <algorithm>
#include <stdexcept>

#ifndef KV_CONFORMANCE_PEER_PATH
#error "KV_CONFORMANCE_PEER_PATH must name the peer executable"
#endif

namespace mstar::kv::testing {

namespace {

std::vector<std::string> peer_args(const PeerSpec& spec) {
  std::vector<std::string> args = {KV_CONFORMANCE_PEER_PATH,
                                   "--engine", spec.engine,
                                   "--layout", layout_arg(spec.layout),
                                   "--tokens", std::to_string(spec.tokens),
                                   "--seed", std::to_string(spec.seed),
                                   "--scatter", std::to_string(spec.scatter_seed)};
  if (spec.lease_ms >= 0) {
    args.push_back("--lease-ms");
    args.push_back(std::to_string(spec.lease_ms));
  }
  for (const auto& [k, v] : spec.extra) {
    args.push_back("--extra");
    args.push_back(k + "=" + v);
  }
  return args;
}

}  // namespace

// The peer's stderr stays the test's (UCX and Mooncake log there); only its
// stdout, where it prints "SEQ <hex>" or "ERR <message>", is read.
PeerProcess::PeerProcess(const PeerSpec& spec, std::chrono::milliseconds timeout)
    : child_(peer_args(spec), spec.env, /*merge_stderr=*/false) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    std::string line;
    try {
      line = child_.read_line(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::runtime_error& e) {
      child_.kill_now();
      throw std::runtime_error(std::string("peer did not publish its sequence: ") + e.what());
    }
    if (line.rfind("SEQ ", 0) == 0) {
      seq_ = SequenceInfo::decode(from_hex(line.substr(4)));
      return;
    }
    if (line.rfind("ERR ", 0) == 0) {
      child_.kill_now();
      throw std::runtime_error("peer failed: " + line.substr(4));
    }
  }
}

const SequenceInfo& PeerProcess::read_sequence(std::chrono::milliseconds timeout) {
  const std::string line = child_.read_line(timeout);
  if (line.rfind("SEQ ", 0) != 0) throw std::runtime_error("peer said: " + line);
  seq_ = SequenceInfo::decode(from_hex(line.substr(4)));
  return seq_;
}

void PeerProcess::kill_now() { child_.kill_now(); }

void PeerProcess::quit() {
  if (child_.reaped()) return;
  try {
    child_.write_line("quit");
  } catch (const std::runtime_error&) {
    child_.kill_now();
    return;
  }
  // A moment to shut down cleanly; wait() kills it after that.
  child_.wait(std::chrono::seconds(2));
}

}  // namespace mstar::kv::testing
