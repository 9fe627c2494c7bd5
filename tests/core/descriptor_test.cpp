// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "core/codec.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

SequenceInfo sample() {
  SequenceInfo s;
  s.seq_id = 0x1122334455667788ULL;
  s.num_tokens = 37;
  s.page_size = 16;
  s.page_indices = {9, 4, 1000};
  s.kv_transfer_info = {"shm", {1, 2, 3, 4, 5}};
  return s;
}

void expect_corrupt(std::span<const std::uint8_t> bytes, const std::string& needle) {
  testing::expect_error([&] { SequenceInfo::decode(bytes); }, StatusCode::kCorruptDescriptor,
                        {needle});
}

// Re-frames a hand-built payload with a valid checksum, to reach the checks
// that sit behind the CRC.
std::vector<std::uint8_t> frame(const codec::ByteWriter& w) {
  auto copy = w;
  return codec::encode_frame(codec::FrameKind::kSequenceInfo, copy.data());
}

TEST(Descriptor, SequenceInfoRoundTrips) {
  const SequenceInfo s = sample();
  EXPECT_EQ(SequenceInfo::decode(s.encode()), s);
  SequenceInfo empty;
  empty.page_size = 1;
  EXPECT_EQ(SequenceInfo::decode(empty.encode()), empty);
}

TEST(Descriptor, TransferInfoRoundTrips) {
  const KVTransferInfo t{"ucx", std::vector<std::uint8_t>(300, 7)};
  EXPECT_EQ(KVTransferInfo::decode(t.encode()), t);
  EXPECT_EQ(KVTransferInfo::decode(KVTransferInfo{}.encode()), KVTransferInfo{});
}

TEST(Descriptor, EveryTruncationIsRejected) {
  const auto bytes = sample().encode();
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(SequenceInfo::decode(std::span(bytes).first(n)), Error) << n;
  }
}

TEST(Descriptor, EveryFlippedByteIsRejected) {
  const auto good = sample().encode();
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x40;
    EXPECT_THROW(SequenceInfo::decode(bad), Error) << "byte " << i;
  }
}

TEST(Descriptor, WrongKindVersionAndMagic) {
  const auto t = KVTransferInfo{"shm", {}}.encode();
  expect_corrupt(t, "frame kind 1, expected 2");
  auto s = sample().encode();
  s[0] = 'X';
  expect_corrupt(s, "not an mstar-kv descriptor");
  codec::ByteWriter payload;
  payload.u64(1);
  auto v2 = codec::encode_frame(codec::FrameKind::kSequenceInfo, payload.data());
  v2[4] = 2;  // version 2, then fix the CRC so only the version is wrong
  const std::uint32_t crc = codec::crc32c(std::span(v2).first(v2.size() - 4));
  for (int i = 0; i < 4; ++i) v2[v2.size() - 4 + i] = static_cast<std::uint8_t>(crc >> (8 * i));
  expect_corrupt(v2, "unsupported version 2");
}

// A SequenceInfo payload's head: seq_id, num_tokens, page_size, page count.
codec::ByteWriter head(std::uint64_t seq_id, std::uint64_t tokens, std::uint32_t page_size,
                       std::uint32_t pages) {
  codec::ByteWriter w;
  w.u64(seq_id);
  w.u64(tokens);
  w.u32(page_size);
  w.u32(pages);
  return w;
}

TEST(Descriptor, OversizedFieldsAreRejected) {
  codec::ByteWriter w = head(1, 10, 16, 0xFFFFFFFFu);  // page count far over the limit
  expect_corrupt(frame(w), "exceed the limit");

  codec::ByteWriter w2 = head(1, 10, 16, 1000);  // claims 1000 pages, carries none
  expect_corrupt(frame(w2), "truncated: 1000 pages need 4000 bytes");

  codec::ByteWriter w3 = head(1, 1, 16, 1);
  w3.u32(0);
  w3.u32(1u << 30);  // engine name length
  expect_corrupt(frame(w3), "length 1073741824 exceeds limit 64");
}

TEST(Descriptor, InconsistentFieldsAreRejected) {
  codec::ByteWriter w = head(1, 5, 16, 0);  // 5 tokens, no pages
  w.str("");
  w.bytes({});
  expect_corrupt(frame(w), "0 pages for 5 tokens of page size 16: expected 1");

  codec::ByteWriter w2 = head(1, 1, 16, 1);
  w2.u32(0);
  w2.str("");
  const std::uint8_t junk[] = {1};
  w2.bytes(junk);
  expect_corrupt(frame(w2), "local-only (empty) transfer info carries 1 payload bytes");

  codec::ByteWriter w3 = head(1, 1, 16, 1);
  w3.u32(0);
  w3.str("../etc");
  w3.bytes({});
  expect_corrupt(frame(w3), "engine name must be");

  auto trailing = sample().encode();
  codec::ByteWriter w4 = head(1, 0, 16, 0);
  w4.str("");
  w4.bytes({});
  w4.u64(0);  // epoch
  w4.u64(0);  // lease_expiry_ms
  w4.u8(0);
  expect_corrupt(frame(w4), "1 unexpected trailing bytes");
}

// The page count is exactly what the tokens fill at the stated page size
// (100 tokens in 1 page of 16, 1 token in 5 pages were accepted).
TEST(Descriptor, PageCountMustMatchTokensAndPageSize) {
  auto encoded = [](std::uint64_t tokens, std::uint32_t page_size, std::uint32_t pages) {
    SequenceInfo s;
    s.seq_id = 7;
    s.num_tokens = tokens;
    s.page_size = page_size;
    for (std::uint32_t i = 0; i < pages; ++i) s.page_indices.push_back(i);
    return s.encode();
  };
  expect_corrupt(encoded(100, 16, 1), "1 pages for 100 tokens of page size 16: expected 7");
  expect_corrupt(encoded(1, 16, 5), "5 pages for 1 tokens of page size 16: expected 1");
  expect_corrupt(encoded(0, 16, 1), "1 pages for 0 tokens of page size 16: expected 0");
  expect_corrupt(encoded(32, 16, 3), "3 pages for 32 tokens of page size 16: expected 2");
  expect_corrupt(encoded(~std::uint64_t{0}, 1, 1),
                 "1 pages for 18446744073709551615 tokens of page size 1: expected "
                 "18446744073709551615");
  expect_corrupt(encoded(16, 0, 1), "page size 0 out of range [1, 65536]");
  expect_corrupt(encoded(16, 65537, 1), "page size 65537 out of range [1, 65536]");
  const std::vector<std::tuple<std::uint64_t, std::uint32_t, std::uint32_t>> good = {
      {100, 16, 7}, {96, 16, 6}, {1, 16, 1}, {0, 16, 0}, {65536, 65536, 1}, {5, 1, 5}};
  for (auto [tokens, page_size, pages] : good) {
    const auto s = SequenceInfo::decode(encoded(tokens, page_size, pages));
    EXPECT_EQ(s.page_indices.size(), pages);
    EXPECT_EQ(s.page_size, page_size);
  }
}

// page_epochs (shared pages): the exceptions to the descriptor's epoch.
SequenceInfo shared_sample() {
  SequenceInfo s = sample();
  s.kv_transfer_info.epoch = 5;
  s.kv_transfer_info.page_epochs = {{4, 3}, {1000, 9}};
  return s;
}

// sample()'s payload by hand up to its last field (lease_expiry_ms), with
// `epoch`, for the page_epochs section to follow.
codec::ByteWriter shared_head(std::uint64_t epoch = 5) {
  codec::ByteWriter w = head(0x1122334455667788ULL, 37, 16, 3);
  for (std::uint32_t p : {9u, 4u, 1000u}) w.u32(p);
  w.str("shm");
  const std::uint8_t payload[] = {1, 2, 3, 4, 5};
  w.bytes(payload);
  w.u64(epoch);
  w.u64(0);  // lease_expiry_ms
  return w;
}

TEST(Descriptor, PageEpochsRoundTripAndLeaveUnsharedBytesAsTheyWere) {
  const SequenceInfo s = shared_sample();
  EXPECT_EQ(SequenceInfo::decode(s.encode()), s);
  EXPECT_EQ(KVTransferInfo::decode(s.kv_transfer_info.encode()), s.kv_transfer_info);
  SequenceInfo other = s;
  other.kv_transfer_info.page_epochs[1].epoch = 10;
  EXPECT_NE(other, s);
  EXPECT_NE(other.kv_transfer_info, s.kv_transfer_info);
  EXPECT_EQ(s.kv_transfer_info.epoch_of(4), 3u);
  EXPECT_EQ(s.kv_transfer_info.epoch_of(9), 5u);
  EXPECT_EQ(s.kv_transfer_info.epoch_of(1000), 9u);
  const KVTransferInfo one = s.kv_transfer_info.with_epoch(9);
  EXPECT_EQ(one.epoch, 9u);
  EXPECT_TRUE(one.page_epochs.empty());
  EXPECT_EQ(one.payload, s.kv_transfer_info.payload);
  // An unshared sequence encodes as before the field existed (no section),
  // so frames of older builds decode and older builds decode ours.
  SequenceInfo plain = sample();
  plain.kv_transfer_info.epoch = 5;
  EXPECT_EQ(plain.encode(), frame(shared_head()));
  EXPECT_EQ(SequenceInfo::decode(frame(shared_head())), plain);
  // The section is the frame's tail: tag 1, count, (page, epoch) each.
  codec::ByteWriter w = shared_head();
  w.u8(1);
  w.u32(2);
  w.u32(4);
  w.u64(3);
  w.u32(1000);
  w.u64(9);
  EXPECT_EQ(s.encode(), frame(w));
}

TEST(Descriptor, BadPageEpochsAreRefusedNamingTheField) {
  struct Entry {
    std::uint32_t page;
    std::uint64_t epoch;
  };
  auto section = [](std::vector<Entry> entries, std::uint64_t epoch = 5,
                    std::optional<std::uint32_t> count = std::nullopt) {
    codec::ByteWriter w = shared_head(epoch);
    w.u8(1);
    w.u32(count.value_or(static_cast<std::uint32_t>(entries.size())));
    for (const Entry& e : entries) {
      w.u32(e.page);
      w.u64(e.epoch);
    }
    return frame(w);
  };
  auto expect_bad = [](const std::vector<std::uint8_t>& bytes, const std::string& why) {
    testing::expect_error([&] { SequenceInfo::decode(bytes); }, StatusCode::kCorruptDescriptor,
                          {"SequenceInfo field 'page_epochs'", why});
  };
  expect_bad(section({{1000, 9}, {4, 3}}),
             "entry 1 names page 4 after page 1000: pages must be ascending and named once");
  expect_bad(section({{4, 3}, {4, 7}}), "entry 1 names page 4 after page 4");
  expect_bad(section({{4, 0}}), "page 4 carries epoch 0 (0 is a free page)");
  expect_bad(section({{4, 5}}), "page 4 carries epoch 5, the descriptor's own");
  expect_bad(section({{7, 3}}), "page 7 is not one of the sequence's 3 pages");
  expect_bad(section({}), "an empty section");
  expect_bad(section({{4, 3}}, 5, 3), "truncated: 3 entries need 36 bytes, 12 left");
  expect_bad(section({}, 5, 0xFFFFFFFFu), "4294967295 entries exceed the limit of 16777216");
  expect_bad(section({{4, 3}}, 0), "1 entries on a descriptor without an epoch (epoch 0)");
  // Every truncation and every flipped byte of a shared descriptor.
  const auto good = shared_sample().encode();
  for (std::size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(SequenceInfo::decode(std::span(good).first(n)), Error) << n;
  }
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x40;
    EXPECT_THROW(SequenceInfo::decode(bad), Error) << "byte " << i;
  }
  // A KVTransferInfo frame checks the same (bar the sequence's pages).
  KVTransferInfo t{"shm", {1}, 5, {{3, 4}, {2, 6}}};
  testing::expect_error([&] { KVTransferInfo::decode(t.encode()); }, StatusCode::kCorruptDescriptor,
                        {"KVTransferInfo", "page_epochs", "names page 2 after page 3"});
  t = KVTransferInfo{"", {}, 0, {{3, 4}}};
  testing::expect_error([&] { KVTransferInfo::decode(t.encode()); }, StatusCode::kCorruptDescriptor,
                        {"page_epochs", "(local-only)"});
}

TEST(Descriptor, LayoutDecodingValidates) {
  KVLayout l = testing::make_layout(2, 4, 16, 1, 64);
  codec::ByteWriter w;
  w.layout(l);
  codec::ByteReader r(w.data(), "test");
  EXPECT_EQ(r.layout("layout"), l);
  l.page_size = 0;
  codec::ByteWriter w2;
  w2.layout(l);
  codec::ByteReader r2(w2.data(), "test");
  testing::expect_error([&] { r2.layout("layout"); }, StatusCode::kCorruptDescriptor,
                        {"page_size 0 out of range"});
  auto raw = w.data();
  raw[20] = 9;  // dtype byte
  codec::ByteReader r3(raw, "test");
  EXPECT_THROW(r3.layout("layout"), Error);
}

// The wire bytes of a layout (codec.cpp) are those every earlier build
// wrote: descriptors published before layer_page existed decode unchanged.
TEST(Descriptor, LayoutBytesOfTheFirstTwoOrdersAreUnchanged) {
  // 2 layers, 4 pages, 16 tokens, 1 head, 64 dims, bf16 (2), has_v, order,
  // page order, total_kv_heads 0, first_kv_head 0; little-endian.
  auto golden = [](std::uint8_t order, std::uint8_t page_order) {
    return std::vector<std::uint8_t>{2,  0, 0, 0, 4, 0, 0,     0,          16, 0, 0, 0, 1, 0, 0, 0,
                                     64, 0, 0, 0, 2, 1, order, page_order, 0,  0, 0, 0, 0, 0, 0, 0};
  };
  for (auto [co, po] : {std::pair{CacheOrder::kLayerMajor, PageOrder::kNHD},
                        std::pair{CacheOrder::kPageMajor, PageOrder::kHND}}) {
    const KVLayout l = testing::make_layout(2, 4, 16, 1, 64, DType::kBFloat16, co, po);
    const auto bytes = golden(static_cast<std::uint8_t>(co), static_cast<std::uint8_t>(po));
    codec::ByteWriter w;
    w.layout(l);
    EXPECT_EQ(w.data(), bytes) << l.to_string();
    codec::ByteReader r(bytes, "old descriptor");
    EXPECT_EQ(r.layout("layout"), l);
  }
}

TEST(Descriptor, LayerPageLayoutRoundTrips) {
  for (auto po : {PageOrder::kNHD, PageOrder::kHND}) {
    KVLayout l = testing::make_layout(3, 8, 16, 2, 64, DType::kFloat16, CacheOrder::kLayerPage, po);
    l.total_kv_heads = 4;
    l.first_kv_head = 2;
    codec::ByteWriter w;
    w.layout(l);
    EXPECT_EQ(w.data()[22], 2u);  // the cache order's byte
    codec::ByteReader r(w.data(), "test");
    EXPECT_EQ(r.layout("layout"), l);
  }
}

// An order this build does not know is a corrupt descriptor naming the
// field and the value, not a layout read in some other order.
TEST(Descriptor, OrderOutOfRangeIsRefusedByName) {
  codec::ByteWriter w;
  w.layout(testing::make_layout(2, 4, 16, 1, 64, DType::kBFloat16, CacheOrder::kLayerPage));
  for (std::uint8_t bad : {3, 7, 255}) {
    auto raw = w.data();
    raw[22] = bad;
    codec::ByteReader r(raw, "ShmKVTransferInfo");
    testing::expect_error([&] { r.layout("layout"); }, StatusCode::kCorruptDescriptor,
                          {"ShmKVTransferInfo field 'layout'",
                           "cache_order " + std::to_string(bad) + " out of range [0, 2]"});
  }
  auto raw = w.data();
  raw[23] = 2;
  codec::ByteReader r(raw, "test");
  testing::expect_error([&] { r.layout("layout"); }, StatusCode::kCorruptDescriptor,
                        {"field 'layout'", "page_order 2 out of range [0, 1]"});
}

}  // namespace
}  // namespace mstar::kv
