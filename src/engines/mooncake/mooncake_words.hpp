// Copyright mstar-kv authors.
//
// The reads that bring an owner's per-page words (8-byte page epochs,
// epochs.hpp; 4-byte layer readiness words, readiness.hpp) of a set of pages
// into the reader's registered scratch memory, used by the epoch checks
// around a read (mooncake_connect.cpp) and the layer watch
// (mooncake_readiness.cpp). Private to the Mooncake engine.
//
// Mooncake moves every request as its own message (over TCP: one request,
// one round trip on one of its connections), so a read per word made a
// round of the layer watch over 256 pages cost ~12 ms on loopback, as long
// as a layer's transfer. The words are read in runs instead: the pages'
// slots of the owner's table, sorted, form runs of the table, two runs
// closer than kMaxGapBytes merging (the words in the gap are read and
// ignored: a few hundred bytes cost nothing beside a round trip), so a
// sequence whose pages are scattered over a range of the cache costs a few
// requests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mstar/kv/util/status.hpp"
#include "rma/rma_backend.hpp"

namespace mstar::kv::mooncake {

inline constexpr std::uint64_t kMaxGapBytes = 512;

struct WordReads {
  // CopySpans: remote offsets from the owner's table base, local offsets
  // from the scratch memory's base; disjoint, inside [local_base,
  // local_base + bytes).
  std::vector<rma::RmaRead> reads;
  // For pages[i]: the local offset of its word.
  std::vector<std::uint64_t> slot;
  std::uint64_t local_base = 0;
  std::uint64_t bytes = 0;  // scratch bytes the reads fill, from local_base
};

// The runs of `width`-byte words (4 or 8) of `pages` (owner page indices,
// any order, repeats allowed), landing from local_base. Throws
// Error(kInternal) for another width or an empty page set.
WordReads word_reads(std::span<const std::uint32_t> pages, std::uint64_t width,
                     std::uint64_t local_base = 0);

// The layer watch's three reads of one round into one scratch area: the
// epochs (phase 0), the readiness words (1), the epochs again (2), each
// part 8-byte aligned after the one before.
struct WatchReads {
  WordReads phase[3];
  std::uint64_t bytes = 0;  // the scratch area they need
};
WatchReads watch_reads(std::span<const std::uint32_t> pages);

// The checks of what the reads brought, in one place for the C++ engine and
// the wheel engine (bound as mstar_kv._core._MooncakeEpochWords and
// _MooncakeWatchWords). `scratch` is the memory the reads landed in (from
// offset 0); `pages` those the reads were made for. Error(kInternal) when
// scratch is shorter than the reads need.
//
// The epochs of word_reads(pages, 8): OK when every page carries `expect`,
// else kStaleDescriptor (stale_page_status) naming the first page that does
// not, its word and `when` ("before the copy", "during the copy").
Status check_epoch_words(const WordReads& reads, std::span<const std::uint32_t> pages,
                         std::span<const std::byte> scratch, std::uint64_t expect,
                         std::string_view when);
// One round of the layer watch (watch_reads(pages)): the checks of
// check_layer_readiness (readiness.hpp): each page carries `epoch` before and
// after its word was read (else kStaleDescriptor), no word is above
// num_layers or below `floor` (else kCorruptDescriptor naming the page and
// both values). On success *layers_ready is the least word (>= floor).
Status check_watch_words(const WatchReads& reads, std::span<const std::uint32_t> pages,
                         std::span<const std::byte> scratch, std::uint64_t epoch,
                         std::uint32_t num_layers, std::uint32_t floor,
                         std::uint32_t* layers_ready);

}  // namespace mstar::kv::mooncake
