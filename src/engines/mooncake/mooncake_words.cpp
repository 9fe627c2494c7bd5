// Copyright mstar-kv authors.
#include "mooncake_words.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::mooncake {

WordReads word_reads(std::span<const std::uint32_t> pages, std::uint64_t width,
                     std::uint64_t local_base) {
  if ((width != 4 && width != 8) || pages.empty()) {
    throw Error(StatusCode::kInternal, "Mooncake word reads of " + std::to_string(pages.size()) +
                                           " pages, " + std::to_string(width) + " bytes each");
  }
  std::vector<std::uint32_t> sorted(pages.begin(), pages.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  WordReads out;
  out.local_base = local_base;
  // Runs [first, last] of page indices; a gap of at most kMaxGapBytes of
  // words between two pages joins them.
  std::size_t i = 0;
  while (i < sorted.size()) {
    std::size_t j = i;
    while (j + 1 < sorted.size() &&
           (std::uint64_t{sorted[j + 1]} - sorted[j] - 1) * width <= kMaxGapBytes) {
      ++j;
    }
    const std::uint64_t len = (std::uint64_t{sorted[j]} - sorted[i] + 1) * width;
    // CopySpan is {local_offset, remote_offset, length} (planner.hpp).
    out.reads.push_back(rma::RmaRead{.local_offset = local_base + out.bytes,
                                     .remote_offset = std::uint64_t{sorted[i]} * width,
                                     .length = len});
    out.bytes += len;
    i = j + 1;
  }
  out.slot.reserve(pages.size());
  for (std::uint32_t p : pages) {
    const std::uint64_t at = std::uint64_t{p} * width;
    // The run holding p: the last one starting at or before it.
    const auto it = std::upper_bound(
        out.reads.begin(), out.reads.end(), at,
        [](std::uint64_t v, const rma::RmaRead& r) { return v < r.remote_offset; });
    const rma::RmaRead& r = *(it - 1);
    out.slot.push_back(r.local_offset + (at - r.remote_offset));
  }
  return out;
}

WatchReads watch_reads(std::span<const std::uint32_t> pages) {
  const auto align8 = [](std::uint64_t v) { return (v + 7) / 8 * 8; };
  WatchReads w;
  w.phase[0] = word_reads(pages, 8, 0);
  w.phase[1] = word_reads(pages, 4, align8(w.phase[0].bytes));
  w.phase[2] = word_reads(pages, 8, align8(w.phase[1].local_base + w.phase[1].bytes));
  w.bytes = w.phase[2].local_base + w.phase[2].bytes;
  return w;
}

namespace {

void require_scratch(std::uint64_t need, std::span<const std::byte> scratch) {
  if (scratch.size() < need) {
    throw Error(StatusCode::kInternal,
                "Mooncake word check over " + std::to_string(scratch.size()) +
                    " bytes of scratch; the reads fill " + std::to_string(need));
  }
}

template <typename Word>
Word word_at(std::span<const std::byte> scratch, std::uint64_t slot) {
  Word w = 0;
  std::memcpy(&w, scratch.data() + slot, sizeof(Word));
  return w;
}

}  // namespace

Status check_epoch_words(const WordReads& reads, std::span<const std::uint32_t> pages,
                         std::span<const std::byte> scratch, std::uint64_t expect,
                         std::string_view when) {
  require_scratch(reads.local_base + reads.bytes, scratch);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const auto word = word_at<std::uint64_t>(scratch, reads.slot.at(i));
    if (word != expect) return stale_page_status(pages[i], word, expect, when);
  }
  return Status::ok();
}

Status check_watch_words(const WatchReads& reads, std::span<const std::uint32_t> pages,
                         std::span<const std::byte> scratch, std::uint64_t epoch,
                         std::uint32_t num_layers, std::uint32_t floor,
                         std::uint32_t* layers_ready) {
  require_scratch(reads.bytes, scratch);
  // Epochs first, both reads (the seqlock): a word is only the sequence's
  // when its page carried the sequence's epoch before and after it was read.
  // A page that got a new owner meanwhile may show the reset word (0), which
  // must be reported stale, never as readiness going backwards.
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const auto before = word_at<std::uint64_t>(scratch, reads.phase[0].slot.at(i));
    if (before != epoch) {
      return stale_page_status(pages[i], before, epoch, "before its readiness was read");
    }
  }
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const auto after = word_at<std::uint64_t>(scratch, reads.phase[2].slot.at(i));
    if (after != epoch) {
      return stale_page_status(pages[i], after, epoch, "while its readiness was read");
    }
  }
  std::uint32_t lowest = std::numeric_limits<std::uint32_t>::max();
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const auto word = word_at<std::uint32_t>(scratch, reads.phase[1].slot.at(i));
    if (Status odd = check_readiness_word(pages[i], word, num_layers, floor); !odd.is_ok()) {
      return odd;
    }
    lowest = std::min(lowest, word);
  }
  *layers_ready = pages.empty() ? num_layers : lowest;
  return Status::ok();
}

}  // namespace mstar::kv::mooncake
