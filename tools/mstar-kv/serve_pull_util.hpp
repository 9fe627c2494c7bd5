// Copyright mstar-kv authors.
//
// Helpers of `mstar-kv serve` / `pull` (cmd_serve_pull.cpp): addresses, the
// flat JSON of the /meta endpoint, engine options from flags, signals.
#pragma once

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "args.hpp"
#include "mstar/kv/kv.hpp"
#include "util/host_port.hpp"

namespace mstar::kv::cli {

inline constexpr std::uint16_t kDefaultHttpPort = 23480;  // outside 32768-60999

// "HOST[:PORT]" (PORT defaults to kDefaultHttpPort; util/host_port.hpp, the
// parser the ucx engine's session ids use too); `flag` names the option in
// errors.
inline HostPort parse_host_port(const std::string& s, const char* flag) {
  return mstar::kv::parse_host_port(s, flag, kDefaultHttpPort);
}

// The layout as flat JSON (the /meta endpoint's "layout").
std::string layout_json(const KVLayout& l);

// Minimal reader for the flat JSON layout_json() and /meta write: the value
// after "key": (strings without their quotes). Throws kCorruptDescriptor.
std::string json_value(const std::string& json, const std::string& key);
std::uint64_t json_u64(const std::string& json, const std::string& key);

// The layout in /meta's JSON, with --cache-order / --page-order of `args`
// in place of the server's when given, for num_pages pages (at least 1);
// validated.
KVLayout layout_from_meta(const std::string& meta, const Args& args, std::uint32_t num_pages);

// "17" -> 17; false when not a decimal id of at most 19 digits.
bool parse_id(const std::string& s, std::uint64_t* id);

// --mooncake-lib and --extra K=V,K=V into o.extra.
void parse_extra(const Args& args, EngineOptions& o);

// Blocks SIGINT/SIGTERM in every thread started after it; wait() returns
// when one arrives or `stop` becomes true.
class SignalWaiter {
 public:
  SignalWaiter();
  // Polls for a signal until `stop` becomes true; returns true on a signal.
  bool wait(const std::atomic<bool>& stop);

 private:
  sigset_t set_;
};

}  // namespace mstar::kv::cli
