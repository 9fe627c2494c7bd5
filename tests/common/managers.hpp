// Copyright mstar-kv authors.
//
// A reader's manager for the engine suites: over the engine the factory
// makes from `info`, or, with `fault_wrapper`, over that engine wrapped in a
// FaultInjectingEngine that injects nothing (which must keep every engine
// invariant).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "mstar/kv/engines/fault_injection.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

// A reader's manager over `engine` with this timeout and these options.
inline std::unique_ptr<KVTransferManager> reader_manager(
    const std::string& engine, std::shared_ptr<KVCache> cache, std::chrono::milliseconds timeout,
    std::map<std::string, std::string> extra = {}) {
  EngineOptions o;
  o.timeout = timeout;
  o.extra = std::move(extra);
  return std::make_unique<KVTransferManager>(TransferEngineInfo{"decode", "", engine, o},
                                             std::move(cache));
}

inline std::unique_ptr<KVTransferManager> make_manager(const TransferEngineInfo& info,
                                                       std::shared_ptr<KVCache> cache,
                                                       bool fault_wrapper) {
  if (!fault_wrapper) return std::make_unique<KVTransferManager>(info, std::move(cache));
  auto wrapped = std::make_unique<FaultInjectingEngine>(make_engine(info, cache), cache->layout());
  return std::make_unique<KVTransferManager>(std::move(cache), std::move(wrapped),
                                             info.options.timeout);
}

}  // namespace mstar::kv::testing
