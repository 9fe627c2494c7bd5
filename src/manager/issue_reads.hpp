// Copyright mstar-kv authors.
//
// One pull made of several engine reads (per epoch group, per shard),
// private to the manager.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/core/planner.hpp"

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

// Reads by the epoch their remote page must carry, in order of first
// appearance: epoch_of(read) for each (it may throw to refuse a read, and
// sees every read before anything is done with them).
using EpochGroups = std::vector<std::pair<std::uint64_t, std::vector<KVReadInfo>>>;
template <class EpochOf>
EpochGroups group_by_epoch(std::span<const KVReadInfo> reads, EpochOf&& epoch_of) {
  EpochGroups groups;
  for (const KVReadInfo& r : reads) {
    const std::uint64_t epoch = epoch_of(r);
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& grp) { return grp.first == epoch; });
    if (g == groups.end()) {
      groups.emplace_back(epoch, std::vector<KVReadInfo>{});
      g = std::prev(groups.end());
    }
    g->second.push_back(r);
  }
  return groups;
}

// One pull of pages that carry several epochs (a request-scoped descriptor,
// a sequence sharing pages): `reads` grouped by epoch (group_by_epoch), and
// one engine read per group, joined. Each group reads through the handle of
// `opened` with its epoch, or one open_for(epoch) adds there. A single
// group is one engine read; no reads, no engine read (std::nullopt).
template <class EpochOf, class OpenFor>
std::optional<TransferFuture> issue_by_epoch(KVTransferEngine& engine,
                                             std::span<const KVReadInfo> reads, EpochOf&& epoch_of,
                                             std::vector<RemoteHandle>& opened,
                                             OpenFor&& open_for) {
  const EpochGroups groups = group_by_epoch(reads, epoch_of);
  auto handle_for = [&](std::uint64_t epoch) -> const RemoteCache& {
    for (const RemoteHandle& h : opened) {
      if (h->epoch() == epoch) return *h;
    }
    opened.push_back(open_for(epoch));
    return *opened.back();
  };
  if (groups.size() == 1) {
    return engine.read_batched_async(handle_for(groups.front().first), groups.front().second);
  }
  return issue_joined([&](std::vector<TransferFuture>& issued) {
    for (const auto& [epoch, group] : groups) {
      auto f = engine.read_batched_async(handle_for(epoch), group);
      if (f) issued.push_back(std::move(*f));
    }
  });
}

}  // namespace mstar::kv
