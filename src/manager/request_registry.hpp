// Copyright mstar-kv authors.
//
// RequestRegistry: the publications of one manager's requests and the page
// epochs they stamp (the scheme of requests.hpp), private to the manager.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/requests.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

// Thread safety: every method is safe from any thread (one mutex; epochs
// are stamped under it, so that a page's holders and its epoch agree).
class RequestRegistry {
 public:
  explicit RequestRegistry(std::shared_ptr<KVCache> cache);

  // Records `p` (replacing the request's earlier publication of that
  // label) and stamps its pages; returns each page's epoch. Throws
  // Error(kInvalidArgument) naming the value and its limit, before
  // anything changes: a name beyond RequestKVTransferInfo::kMaxNameBytes, a
  // page out of the cache's range or named twice, more pages than a
  // descriptor carries, seq_len beyond the pages.
  std::vector<std::uint64_t> publish(const RequestPublication& p);

  // Whether (request_id, label) is published (and not removed since).
  bool holds(std::string_view request_id, std::string_view label) const;

  // Releases every publication of `request_id` (no-op when there is none).
  void remove(std::string_view request_id);

  // Releases every publication (cleanup): their pages are stamped 0.
  void clear();

  std::size_t size() const;

 private:
  struct Publication {
    std::optional<std::int64_t> generation;
    std::vector<std::uint32_t> pages;
    std::uint64_t seq_len = 0;
    std::vector<std::uint64_t> epochs;
  };
  using Labels = std::map<std::string, Publication, std::less<>>;

  void validate(const RequestPublication& p) const;
  // Drops one holder of each page; pages left without one are stamped 0.
  void release_locked(const std::vector<std::uint32_t>& pages) MSTAR_KV_REQUIRES(mu_);

  const std::shared_ptr<KVCache> cache_;
  mutable std::mutex mu_;
  std::map<std::string, Labels, std::less<>> requests_ MSTAR_KV_GUARDED_BY(mu_);
  // Publications naming each page.
  std::vector<std::uint32_t> holders_ MSTAR_KV_GUARDED_BY(mu_);
  std::uint64_t next_epoch_ MSTAR_KV_GUARDED_BY(mu_);
};

}  // namespace mstar::kv
