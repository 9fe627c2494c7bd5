// Copyright mstar-kv authors.
#include "mstar/kv/core/epochs.hpp"

#include <algorithm>
#include <random>
#include <string>

#include "core/shared_word.hpp"

namespace mstar::kv {

namespace {

// The words may be a PROT_READ mapping of another process's table: an
// atomic load of an aligned 8-byte word is a plain load on every target we
// build for, and never writes.
std::uint64_t load_word(const std::uint64_t* w) noexcept { return internal::load_acquire(w); }

}  // namespace

void PageEpochs::stamp(std::span<const std::uint32_t> pages, std::uint64_t epoch) const noexcept {
  if (words_ == nullptr) return;
  for (std::uint32_t p : pages) {
    if (p < num_pages_) {
      internal::store_relaxed(words_ + p, epoch);
    }
  }
  // Orders the stamps before every later store of this thread (the model
  // writing K/V into the pages): a reader whose copy saw such a store sees
  // the new epoch after its own acquire fence.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (mirror_ != nullptr) mirror_->push(words_, pages);
}

std::uint64_t PageEpochs::load(std::uint32_t page) const noexcept {
  if (words_ == nullptr || page >= num_pages_) return 0;
  return load_word(words_ + page);
}

std::uint64_t random_first_epoch() {
  std::random_device rd;
  const std::uint64_t v = (std::uint64_t{rd()} << 32) ^ rd();
  return (v & ((std::uint64_t{1} << 62) - 1)) | 1;
}

Status stale_page_status(std::uint32_t page, std::uint64_t found, std::uint64_t expect,
                         std::string_view when) {
  return {StatusCode::kStaleDescriptor, "remote page " + std::to_string(page) + " changed owner " +
                                            std::string(when) + " (epoch " + std::to_string(found) +
                                            ", the descriptor's " + std::to_string(expect) +
                                            "): the sequence was freed or its pages reused"};
}

bool is_page_epoch_failure(const Status& status) noexcept {
  return status.code() == StatusCode::kStaleDescriptor &&
         status.message().find(" changed owner ") != std::string::npos;
}

Status check_page_epochs(const std::uint64_t* table, std::uint32_t num_pages,
                         std::span<const std::uint32_t> pages, std::uint64_t expect,
                         std::string_view when, bool after_copy) {
  if (after_copy) std::atomic_thread_fence(std::memory_order_acquire);
  for (std::uint32_t p : pages) {
    if (p >= num_pages || table == nullptr) return stale_page_status(p, 0, expect, when);
    const std::uint64_t e = load_word(table + p);
    if (e != expect) return stale_page_status(p, e, expect, when);
  }
  return Status::ok();
}

std::vector<std::uint32_t> remote_pages_of(std::span<const KVReadInfo> reads,
                                           std::uint32_t num_pages) {
  std::vector<std::uint32_t> pages;
  bool out_of_range = false;
  auto keep = [&](const KVReadInfo& r) {
    if (r.remote_page_idx < 0 || r.remote_page_idx >= std::int64_t{num_pages}) {
      if (!out_of_range) pages.push_back(static_cast<std::uint32_t>(r.remote_page_idx));
      out_of_range = true;
      return false;
    }
    return true;
  };
  // Small reads (the common decode-step case) dedupe by scanning; large
  // ones with a bitmap of the remote cache's pages.
  if (reads.size() <= 64) {
    for (const KVReadInfo& r : reads) {
      if (!keep(r)) continue;
      const auto p = static_cast<std::uint32_t>(r.remote_page_idx);
      if (std::find(pages.begin(), pages.end(), p) == pages.end()) pages.push_back(p);
    }
    return pages;
  }
  std::vector<std::uint8_t> seen(num_pages, 0);
  for (const KVReadInfo& r : reads) {
    if (!keep(r)) continue;
    auto& s = seen[static_cast<std::size_t>(r.remote_page_idx)];
    if (s == 0) pages.push_back(static_cast<std::uint32_t>(r.remote_page_idx));
    s = 1;
  }
  return pages;
}

}  // namespace mstar::kv
