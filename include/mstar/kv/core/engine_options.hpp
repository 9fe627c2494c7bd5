// Copyright mstar-kv authors.
//
// What an engine is made from: the options every engine understands and the
// spec's TransferEngineInfo. Engines include this header, not the manager.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "mstar/kv/util/log.hpp"

namespace mstar::kv {

// Options every engine understands, plus engine-specific ones by name.
struct EngineOptions {
  std::uint32_t max_workers = 3;  // copy threads / streams
  // A read that has not finished after this long fails with kTimeout.
  std::chrono::milliseconds timeout{30000};
  // Engine-specific settings, documented in each engine's header
  // (e.g. "mooncake_lib" for the Mooncake engine).
  std::map<std::string, std::string> extra;
  // Page epoch checks (epochs.hpp): a read of pages that changed owner fails
  // with kStaleDescriptor. Turning them off exists only to measure what they
  // cost (mstar-kv bench --epoch-ab); never in production.
  bool check_epochs = true;
  // Where the engine logs (log.hpp): silent unless MSTAR_KV_LOG is set.
  Logger log = Logger::from_env();
};

// The spec's TransferEngineInfo: who this process is to its peers and which
// transfer engine moves its pages. transfer_engine names an engine of the
// factory's table (factory.hpp): "local", "shm", "cuda_ipc", "ucx" or
// "mooncake".
struct TransferEngineInfo {
  std::string my_entity_id;
  std::string my_session_id;
  std::string transfer_engine;
  EngineOptions options;
};

}  // namespace mstar::kv
