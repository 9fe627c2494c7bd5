// Copyright mstar-kv authors.
//
// Request-scoped descriptors: upstream mstar's calling convention (a
// resource key; one descriptor per request, label and content version) over
// the spec's cache-wide descriptor. KVTransferManager publishes, reads and
// releases them (manager.hpp); docs/integrations/mstar.md maps them onto
// upstream's names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"

namespace mstar::kv {

// What a manager serves: `resource_key` names its cache among the caches
// of one worker (upstream: "kv", "thinker_kv", ...); a descriptor of
// another key is refused by name. With `needs_remote_transfer` false the
// cache stays in its worker: the manager publishes nothing (its
// descriptors are the local-only one, the request form std::nullopt).
struct ResourceScope {
  std::string resource_key = "kv";
  bool needs_remote_transfer = true;
};

// One publication: request `request_id`'s cache `label` ("main",
// "cfg_text", ...) holds its first `seq_len` tokens in `page_indices` (in
// order; more pages than the tokens need are allowed, every page distinct
// and in the cache). `reset_generation` is the request's content version
// (std::nullopt is a version too): a new one means "drop what you read and
// read again from 0".
struct RequestPublication {
  std::string request_id;
  std::string label;
  std::vector<std::uint32_t> page_indices;
  std::uint64_t seq_len = 0;
  std::optional<std::int64_t> reset_generation;
};

// The descriptor of one publication. Value type; equal for equal
// publications of one manager (the same bytes). Serialises to a checksummed
// "MSKV" frame; decode treats the bytes as untrusted (Error
// kCorruptDescriptor naming the field: a truncated frame, names beyond
// kMaxNameBytes, page_epochs not one per page or 0, seq_len beyond the
// pages, an owner other than 32 hex digits, an empty engine).
//
// Page epochs (epochs.hpp): pages come from the application's allocator,
// so the manager stamps them when they are published and when they are
// released, in the cache's PageEpochs table, which every engine's readers
// check before and after each copy:
// * A page gets a fresh epoch when it is published and no publication holds
//   it (it may hold anything), and when its only holder republishes it with
//   another reset_generation (it may have been rewritten). A page another
//   publication holds keeps its epoch: the application shares only pages it
//   no longer writes (upstream seals them), so both descriptors name the
//   same bytes. page_epochs holds each page's epoch at publication.
// * Republishing with the same reset_generation keeps the epochs of the
//   pages it keeps (appended tokens land beyond what earlier descriptors
//   name, which stay readable); pages it drops are released.
// * A released page (its last publication removed, dropped, or the manager
//   cleaned up) is stamped 0.
// A pull of a descriptor reads each page with the epoch page_epochs names
// for it (one engine read per distinct epoch, joined), so a page released
// or re-stamped since fails the pull with kStaleDescriptor. Pages still held
// by another publication (shared, unchanged) stay readable after their first
// publisher is removed: their bytes are the ones published.
// The application's part: call remove_request before its allocator hands
// the request's pages to another request, and publish a new
// reset_generation (or remove the request) before it rewrites published
// pages in place. A manager's requests own its cache's epoch table: do not
// also run a KVCachePool over that cache.
struct RequestKVTransferInfo {
  static constexpr std::size_t kMaxNameBytes = 4096;

  std::string resource_key;
  std::string request_id;
  std::string label;
  std::optional<std::int64_t> reset_generation;
  std::uint64_t seq_len = 0;
  std::uint32_t page_size = 0;  // the owner's tokens per page
  std::vector<std::uint32_t> page_indices;
  std::vector<std::uint64_t> page_epochs;  // one per page, never 0
  std::string owner;                       // the publishing manager (random, 32 hex digits)
  KVTransferInfo cache;                    // the engine's descriptor of the whole cache (epoch 0)

  // The engine's descriptor checked against `epoch` (cache with that epoch).
  KVTransferInfo with_epoch(std::uint64_t epoch) const;

  std::vector<std::uint8_t> encode() const;
  static RequestKVTransferInfo decode(std::span<const std::uint8_t> bytes);

  bool operator==(const RequestKVTransferInfo&) const = default;
};

}  // namespace mstar::kv
