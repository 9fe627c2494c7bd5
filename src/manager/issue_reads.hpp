// Copyright mstar-kv authors.
//
// One pull made of several engine reads (per epoch group, per shard),
// private to the manager.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mstar/kv/future.hpp"

namespace mstar::kv {

// Runs `issue(issued)`, which starts reads and appends each future to
// `issued`. If it throws, every read already started is cancelled and
// waited for before the exception goes on (nothing lands after the throw).
// Returns one future for all of them (join_futures), or nullopt when none
// was started.
template <class Issue>
std::optional<TransferFuture> issue_joined(Issue&& issue) {
  std::vector<TransferFuture> issued;
  try {
    issue(issued);
  } catch (...) {
    for (const TransferFuture& f : issued) f.cancel();
    for (const TransferFuture& f : issued) f.wait();
    throw;
  }
  if (issued.empty()) return std::nullopt;
  return join_futures(std::move(issued));
}

}  // namespace mstar::kv
