// Copyright mstar-kv authors.
//
// EngineOptions.extra checks shared by the engines (private). One
// EngineOptions may configure several engines, so each engine looks only at
// the keys of its own prefix ("shm_", "cuda_ipc_", ...) and at none of the
// shared unprefixed keys (e.g. "auth_token"): a key of its prefix that it
// does not know is a typo and is refused, naming the known ones.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::engines {

// Throws Error(kInvalidArgument) for the first key of `extra` that starts
// with `prefix` and is not in `known`; `engine` names the engine.
inline void reject_unknown_keys(const std::map<std::string, std::string>& extra,
                                std::string_view engine, std::string_view prefix,
                                std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : extra) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;  // not this engine's
    bool ok = false;
    for (std::string_view k : known) ok = ok || key == k;
    if (ok) continue;
    std::string list;
    for (std::string_view k : known) list += (list.empty() ? "" : ", ") + std::string(k);
    throw Error(StatusCode::kInvalidArgument,
                "unknown " + std::string(engine) + " option '" + key + "' = '" + value +
                    "' (known " + std::string(prefix) +
                    "* options: " + (list.empty() ? std::string("none") : list) + ")");
  }
}

// "on" -> true, "off" -> false; anything else throws Error(kInvalidArgument)
// naming `what` (the key or environment variable) and the value.
inline bool parse_on_off(const std::string& value, std::string_view what) {
  if (value == "on") return true;
  if (value == "off") return false;
  throw Error(StatusCode::kInvalidArgument,
              std::string(what) + " '" + value + "' is not one of on, off");
}

// The limits every engine puts on the shared options: max_workers in
// [1, max_workers_limit] and a timeout of at least 1 ms (0 once failed every
// read over the inline size at once). `engine` begins the messages.
template <typename Options>  // EngineOptions, or an engine's own with the same two fields
void check_workers_and_timeout(const Options& options, std::string_view engine,
                               std::uint64_t max_workers_limit) {
  if (options.max_workers < 1 || options.max_workers > max_workers_limit) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(engine) + " max_workers " + std::to_string(options.max_workers) +
                    " out of range [1, " + std::to_string(max_workers_limit) + "]");
  }
  if (options.timeout.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument, std::string(engine) + " timeout " +
                                                  std::to_string(options.timeout.count()) +
                                                  " ms out of range [1, ...)");
  }
}

}  // namespace mstar::kv::engines
