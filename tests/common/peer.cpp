// Copyright mstar-kv authors.
#include "common/peer.hpp"

#include <algorithm>
#include <iostream>
#include <mutex>
#include <stdexcept>

#include "common/wire.hpp"

namespace mstar::kv::testing {

Peer::Peer(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
           std::chrono::milliseconds timeout)
    : child_(argv, env, /*merge_stderr=*/false) {
  try {
    await_sequence(timeout);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("peer did not publish its sequence: ") + e.what());
  }
}

const SequenceInfo& Peer::read_sequence(std::chrono::milliseconds timeout) {
  const std::string line = child_.read_line(timeout);
  auto seq = parse_seq_line(line);
  if (!seq) throw std::runtime_error("peer said: " + line);
  seq_ = std::move(*seq);
  return seq_;
}

const SequenceInfo& Peer::await_sequence(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    std::string line;
    try {
      line = child_.read_line(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::runtime_error&) {
      child_.kill_now();
      throw;
    }
    if (auto seq = parse_seq_line(line)) {
      seq_ = std::move(*seq);
      return seq_;
    }
    if (line.rfind("ERR ", 0) == 0) {
      child_.kill_now();
      throw std::runtime_error("peer failed: " + line.substr(4));
    }
  }
}

void Peer::quit() {
  if (child_.reaped()) return;
  try {
    child_.write_line("quit");
  } catch (const std::runtime_error&) {
    child_.kill_now();
    return;
  }
  // A moment to shut down cleanly; then it is killed.
  child_.wait_exit(std::chrono::seconds(2));
}

PeerArgs parse_peer_args(int argc, char** argv, const std::set<std::string>& flags) {
  PeerArgs a;
  std::string layout;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (flags.count(k) != 0) {
      a.flags.insert(k);
      continue;
    }
    if (i + 1 >= argc) throw std::runtime_error("argument " + k + " has no value");
    const std::string v = argv[++i];
    if (k == "--engine")
      a.engine = v;
    else if (k == "--layout")
      layout = v;
    else if (k == "--tokens")
      a.tokens = std::stoull(v);
    else if (k == "--seed")
      a.seed = std::stoull(v);
    else if (k == "--scatter")
      a.scatter = std::stoull(v);
    else if (k == "--lease-ms")
      a.lease = std::chrono::milliseconds(std::stoll(v));
    else if (k == "--extra") {
      const auto eq = v.find('=');
      a.options.extra[v.substr(0, eq)] = eq == std::string::npos ? "" : v.substr(eq + 1);
    } else {
      a.other[k] = v;
    }
  }
  a.layout = parse_layout_arg(layout);
  return a;
}

int run_peer(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    say("ERR " + msg);
    return 1;
  }
}

void say(const std::string& line) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cout << line << std::endl;
}

void say_sequence(const SequenceInfo& seq) { say(seq_line(seq)); }

DeadPeer read_then_kill(Peer& peer, KVTransferManager& m, std::uint64_t tokens,
                        const std::vector<std::uint32_t>& local_pages) {
  DeadPeer d{peer.sequence().kv_transfer_info, peer.sequence().page_indices};
  m.sync_retrieve(0, tokens, local_pages, d.pages, d.descriptor);
  peer.kill_now();
  return d;
}

}  // namespace mstar::kv::testing
