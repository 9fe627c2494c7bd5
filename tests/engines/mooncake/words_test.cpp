// Copyright mstar-kv authors.
//
// The Mooncake engine's reads of an owner's per-page words (the epoch
// checks around a read, the layer watch), and that the engine class
// implements streaming, checked without Mooncake (runs everywhere, CI
// included). The reads are carried out here with memcpy from a table like
// the owner's into a scratch buffer of the size they ask for: each page's
// word must arrive at its slot, and nothing may land outside the buffer.
// The pages are sparse and high (>= 512, where page * 8 lies beyond a
// 4 KiB page), so that swapped offsets cannot pass by accident.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "engines/mooncake/mooncake_words.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::mooncake {
namespace {

constexpr std::uint32_t kTablePages = 4096;

// 1300 distinct owner pages >= 512, 2 or 4 apart, in no order.
std::vector<std::uint32_t> sparse_high_pages() {
  std::vector<std::uint32_t> pages;
  for (std::uint32_t i = 0; i < 1300; ++i) pages.push_back(4095 - i * 3 + (i % 2));
  std::swap(pages[0], pages[700]);
  return pages;
}

// The owner's table of `width`-byte words: page p holds 1000 + 3p.
std::vector<std::byte> owner_table(std::uint64_t width) {
  std::vector<std::byte> t(kTablePages * width);
  for (std::uint32_t p = 0; p < kTablePages; ++p) {
    const std::uint64_t v = 1000 + 3ull * p;
    std::memcpy(t.data() + p * width, &v, width);  // little-endian: the low bytes
  }
  return t;
}

// Carries the reads out into `scratch` (sized by their caller), after
// checking each lands inside it and that no two overlap.
void carry_out(const WordReads& w, std::span<const std::byte> table,
               std::vector<std::byte>& scratch) {
  std::vector<bool> used(scratch.size(), false);
  for (const auto& r : w.reads) {
    ASSERT_GE(r.local_offset, w.local_base);
    ASSERT_LE(r.local_offset + r.length, w.local_base + w.bytes) << "a read beyond its part";
    ASSERT_LE(r.local_offset + r.length, scratch.size()) << "a read beyond the scratch memory";
    ASSERT_LE(r.remote_offset + r.length, table.size()) << "a read beyond the owner's table";
    for (std::uint64_t b = r.local_offset; b < r.local_offset + r.length; ++b) {
      ASSERT_FALSE(used[b]) << "two reads land on byte " << b;
      used[b] = true;
    }
    std::memcpy(scratch.data() + r.local_offset, table.data() + r.remote_offset, r.length);
  }
}

std::uint64_t word_at(const std::vector<std::byte>& scratch, std::uint64_t slot,
                      std::uint64_t width) {
  std::uint64_t v = 0;
  std::memcpy(&v, scratch.data() + slot, width);
  return v;
}

TEST(MooncakeWords, EachPagesEpochArrivesAtItsSlotInAFewRequests) {
  const auto pages = sparse_high_pages();
  const auto table = owner_table(8);
  const WordReads w = word_reads(pages, 8);
  ASSERT_EQ(w.slot.size(), pages.size());
  EXPECT_LE(w.reads.size(), 2u) << "pages 2-4 apart are one run (or two)";
  std::vector<std::byte> scratch(w.bytes);
  carry_out(w, table, scratch);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    EXPECT_EQ(word_at(scratch, w.slot[i], 8), 1000 + 3ull * pages[i]) << "page " << pages[i];
  }
}

TEST(MooncakeWords, FarApartPagesAreOneRequestEachAndRepeatsShareASlot) {
  const std::vector<std::uint32_t> pages{4000, 600, 2048, 600, 3000, 513};
  const auto table = owner_table(8);
  const WordReads w = word_reads(pages, 8, 64);
  EXPECT_EQ(w.reads.size(), 5u);
  EXPECT_EQ(w.bytes, 5u * 8);
  EXPECT_EQ(w.slot[1], w.slot[3]);
  std::vector<std::byte> scratch(64 + w.bytes);
  carry_out(w, table, scratch);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    EXPECT_EQ(word_at(scratch, w.slot[i], 8), 1000 + 3ull * pages[i]) << "page " << pages[i];
  }
}

TEST(MooncakeWords, TheLayerWatchReadsEpochsWordsAndEpochsIntoSeparateParts) {
  const auto pages = sparse_high_pages();
  const auto epochs = owner_table(8);
  const auto ready = owner_table(4);
  const WatchReads w = watch_reads(pages);
  std::vector<std::byte> scratch(w.bytes);
  for (int phase = 0; phase < 3; ++phase) {
    const WordReads& p = w.phase[phase];
    EXPECT_EQ(p.local_base % 8, 0u);
    if (phase > 0) {
      EXPECT_GE(p.local_base, w.phase[phase - 1].local_base + w.phase[phase - 1].bytes)
          << "phase " << phase << " overlaps the one before";
    }
    carry_out(p, phase == 1 ? ready : epochs, scratch);
  }
  for (int phase = 0; phase < 3; ++phase) {
    const std::uint64_t width = phase == 1 ? 4 : 8;
    for (std::size_t i = 0; i < pages.size(); ++i) {
      EXPECT_EQ(word_at(scratch, w.phase[phase].slot[i], width), 1000 + 3ull * pages[i])
          << "phase " << phase << ", page " << pages[i];
    }
  }
}

TEST(MooncakeWords, NoWordsOrAnotherWidthAreRefused) {
  const std::vector<std::uint32_t> none;
  const std::vector<std::uint32_t> one{700};
  for (auto [pages, width] : {std::pair{std::span<const std::uint32_t>(none), 8ull},
                              std::pair{std::span<const std::uint32_t>(one), 2ull}}) {
    try {
      word_reads(pages, width);
      ADD_FAILURE() << pages.size() << " pages of width " << width << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInternal) << e.what();
    }
  }
}

// The checks both Mooncake engines (C++ and wheel) run over what the reads
// brought: a table like the owner's where page p carries epoch 1000 + 3p,
// rewritten so that every sparse high page carries the sequence's epoch,
// then one page made stale or its readiness word broken.
std::vector<std::byte> filled(const WordReads& w, std::span<const std::uint32_t> pages,
                              std::uint64_t width, std::uint64_t value,
                              std::vector<std::byte> scratch) {
  for (std::size_t i = 0; i < pages.size(); ++i) {
    std::memcpy(scratch.data() + w.slot[i], &value, width);
  }
  return scratch;
}

TEST(MooncakeWords, EpochWordsOfEveryPageAreCheckedAndTheStalePageNamed) {
  const auto pages = sparse_high_pages();
  const auto table = owner_table(8);
  const WordReads w = word_reads(pages, 8);
  std::vector<std::byte> scratch(w.bytes);
  carry_out(w, table, scratch);
  // As read: every page its own epoch, none the sequence's 77.
  Status st = check_epoch_words(w, pages, scratch, 77, "before the copy");
  EXPECT_EQ(st.code(), StatusCode::kStaleDescriptor) << st.message();
  EXPECT_NE(st.message().find("remote page " + std::to_string(pages[0]) + " changed owner " +
                              "before the copy (epoch " + std::to_string(1000 + 3 * pages[0])),
            std::string::npos)
      << st.message();
  scratch = filled(w, pages, 8, 77, std::move(scratch));
  EXPECT_TRUE(check_epoch_words(w, pages, scratch, 77, "before the copy").is_ok());
  const std::uint64_t other = 78;
  std::memcpy(scratch.data() + w.slot[900], &other, 8);
  st = check_epoch_words(w, pages, scratch, 77, "during the copy");
  EXPECT_EQ(st.code(), StatusCode::kStaleDescriptor);
  EXPECT_NE(st.message().find("remote page " + std::to_string(pages[900]) +
                              " changed owner during the copy (epoch 78"),
            std::string::npos)
      << st.message();
  // Scratch shorter than the reads fill is the caller's bug, never read past.
  EXPECT_THROW(check_epoch_words(w, pages, std::span(scratch).first(w.bytes - 1), 77, "x"), Error);
}

TEST(MooncakeWords, AWatchRoundIsTheLeastWordAndRefusesStaleBeyondAndBackwards) {
  const auto pages = sparse_high_pages();
  const WatchReads w = watch_reads(pages);
  std::vector<std::byte> scratch(w.bytes);
  scratch = filled(w.phase[0], pages, 8, 77, std::move(scratch));
  scratch = filled(w.phase[2], pages, 8, 77, std::move(scratch));
  scratch = filled(w.phase[1], pages, 4, 3, std::move(scratch));
  const std::uint32_t two = 2;
  std::memcpy(scratch.data() + w.phase[1].slot[1299], &two, 4);
  std::uint32_t ready = 99;
  ASSERT_TRUE(check_watch_words(w, pages, scratch, 77, 4, 0, &ready).is_ok());
  EXPECT_EQ(ready, 2u) << "the least word over the pages";

  auto with = [&](int phase, std::size_t i, std::uint64_t value) {
    auto s = scratch;
    std::memcpy(s.data() + w.phase[phase].slot[i], &value, phase == 1 ? 4 : 8);
    return s;
  };
  auto expect = [&](const std::vector<std::byte>& s, std::uint32_t floor, StatusCode code,
                    const std::string& says) {
    std::uint32_t r = 99;
    const Status st = check_watch_words(w, pages, s, 77, 4, floor, &r);
    EXPECT_EQ(st.code(), code) << st.message();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
    EXPECT_EQ(r, 99u) << "layers_ready set on a failure";
  };
  const std::string p7 = "remote page " + std::to_string(pages[7]);
  expect(with(0, 7, 5), 0, StatusCode::kStaleDescriptor,
         p7 + " changed owner before its readiness was read (epoch 5");
  expect(with(2, 7, 5), 0, StatusCode::kStaleDescriptor,
         p7 + " changed owner while its readiness was read (epoch 5");
  expect(with(1, 7, 5), 0, StatusCode::kCorruptDescriptor,
         p7 + " says 5 layers are ready, beyond the layout's 4 layers");
  expect(scratch, 3, StatusCode::kCorruptDescriptor,
         "remote page " + std::to_string(pages[1299]) +
             " readiness went backwards: 2 layers ready, 3 were ready before");
  // A page that changed owner during the round: its word was reset to 0 by
  // the new owner, and its second epoch read is the new one. Stale, never
  // "readiness went backwards" (the seqlock: words count only between two
  // equal epochs).
  auto reused = with(1, 1200, 0);
  std::uint64_t fresh = 90;
  std::memcpy(reused.data() + w.phase[2].slot[1200], &fresh, 8);
  expect(reused, 2, StatusCode::kStaleDescriptor,
         "remote page " + std::to_string(pages[1200]) +
             " changed owner while its readiness was read (epoch 90");
  EXPECT_THROW(check_watch_words(w, pages, std::span(scratch).first(w.bytes - 1), 77, 4, 0, &ready),
               Error);
}

// The engine class declares watch_layers itself: KVTransferEngine's default
// refuses streaming (kUnavailable), so a Mooncake engine that did not
// forward it to its RMA engine never streamed. (&C::f names the class that
// declares f: C's own override, or the base's.)
TEST(MooncakeWords, TheEngineForwardsLayerWatchesToItsRmaEngine) {
  static_assert(std::is_same_v<decltype(&MooncakeKVTransferEngine::watch_layers),
                               std::unique_ptr<LayerWatch> (MooncakeKVTransferEngine::*)(
                                   const RemoteCache&, std::span<const KVReadInfo>)>,
                "MooncakeKVTransferEngine must override watch_layers");
  SUCCEED();
}

}  // namespace
}  // namespace mstar::kv::mooncake
