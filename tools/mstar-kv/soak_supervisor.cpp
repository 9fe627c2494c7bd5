// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s prefill processes, seen from the supervisor: started as
// re-execs of this program (toolkit::Child), SIGKILLed and reaped, and what
// they publish.
#include <algorithm>

#include "args.hpp"
#include "soak_shared.hpp"
#include "toolkit/seq_line.hpp"

namespace mstar::kv::cli::soak {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void kill_prefill(Prefill& p) { p.child.reset(); }

std::vector<SequenceInfo> start_prefill(Prefill& p, const std::vector<std::string>& args,
                                        std::chrono::milliseconds timeout) {
  toolkit::ChildOptions o;
  o.argv = {toolkit::self_exe(), "soak", "--role", "prefill"};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.in_fd = 0;
  o.out_fd = 1;
  p.child = std::make_unique<toolkit::Child>(o);
  std::vector<SequenceInfo> seqs;
  const auto deadline = Clock::now() + timeout;
  try {
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const std::string line = p.child->read_line(std::max(left, std::chrono::milliseconds(1)));
      // What it prints after READY (page reuse) stays in the child's buffer.
      if (line == "READY") return seqs;
      if (auto seq = toolkit::parse_seq_line(line)) seqs.push_back(std::move(*seq));
    }
  } catch (const Error&) {
  }
  kill_prefill(p);
  throw Error(StatusCode::kPeerFailure, "a " + p.engine + " prefill process did not get ready");
}

std::vector<SequenceInfo> take_published(Prefill& p, std::size_t i, std::size_t keep,
                                         Shared& shared) {
  std::vector<SequenceInfo> fresh;
  while (p.child) {
    const auto line = p.child->poll_line();
    if (!line) break;
    if (auto seq = toolkit::parse_seq_line(*line)) fresh.push_back(std::move(*seq));
  }
  if (fresh.empty()) return fresh;
  std::lock_guard<std::mutex> lock(shared.mu);
  if (!shared.slots[i]) return {};
  auto pub = std::make_shared<Published>(*shared.slots[i]);
  pub->seqs.insert(pub->seqs.end(), fresh.begin(), fresh.end());
  if (pub->seqs.size() > keep) {
    pub->seqs.erase(pub->seqs.begin(),
                    pub->seqs.begin() + static_cast<std::ptrdiff_t>(pub->seqs.size() - keep));
  }
  shared.slots[i] = std::move(pub);
  return fresh;
}

std::vector<std::string> soak_engines(const std::string& list) {
  std::vector<std::string> engines;
  // The soak runs the engines that move host pages between processes with
  // nothing beyond their build.
  std::vector<std::string> soakable;
  for (const EngineTraits& t : engine_table()) {
    if (t.crosses_processes && t.self_contained && t.memory != MemoryKind::kDevice) {
      soakable.push_back(t.name);
    }
  }
  const auto is_soakable = [&](const std::string& e) {
    return std::find(soakable.begin(), soakable.end(), e) != soakable.end();
  };
  const auto built = built_engines();
  if (list.empty()) {
    for (const std::string& e : built) {
      if (is_soakable(e)) engines.push_back(e);
    }
  } else {
    for (std::size_t pos = 0; pos <= list.size();) {
      const std::size_t comma = std::min(list.find(',', pos), list.size());
      const std::string e = list.substr(pos, comma - pos);
      if (!is_soakable(e)) {
        throw Error(StatusCode::kInvalidArgument,
                    "--engines: '" + e + "' is not " + cli::joined(soakable, " or "));
      }
      if (std::find(built.begin(), built.end(), e) == built.end()) {
        throw Error(StatusCode::kUnavailable, "--engines: engine '" + e + "' is not built");
      }
      engines.push_back(e);
      pos = comma + 1;
    }
  }
  if (engines.empty()) {
    throw Error(StatusCode::kUnavailable, "none of " + cli::joined(soakable, ", ") + " is built");
  }
  return engines;
}

}  // namespace mstar::kv::cli::soak
