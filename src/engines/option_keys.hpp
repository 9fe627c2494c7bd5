// Copyright mstar-kv authors.
//
// EngineOptions.extra checks shared by the engines (private). One
// EngineOptions may configure several engines, so each engine looks only at
// the keys of its own prefix ("shm_", "cuda_ipc_", ...) and at none of the
// shared unprefixed keys (e.g. "auth_token"): a key of its prefix that it
// does not know is a typo and is refused, naming the known ones.
#pragma once

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

}  // namespace mstar::kv::engines
