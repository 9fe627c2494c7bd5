// Copyright mstar-kv authors.
//
// A lying owner (raw_owner.hpp: raw UCP, the ucx engine's wire format)
// answers a real reader's gathered read: honestly (every byte lands where
// the read asked), or with a group of spans the read did not ask for, a
// group twice, or a length that does not match its spans. The reader fails
// the read naming it and writes nothing outside the rows it asked for, for
// plain spans and for strided ones (a change of in-page order), reading
// straight into its cache or through staging buffers (ucx_staging=on: it
// then takes only the messages of gather_groups, each whole).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "engines/ucx/raw_owner.hpp"
#include "engines/ucx/ucx_fixture.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;
using testing::RawOwner;

constexpr std::byte kSentinel{0xA5};

// The byte the owner claims at its region offset x.
std::uint8_t owned(std::uint64_t x) { return static_cast<std::uint8_t>((x * 31 + 7) % 251); }

enum class Lie { kNone, kGroupBeyond, kGroupTwice, kLengthTooLong, kLengthTooShort };

// One unit of a gathered read (a span, or a strided span: rows).
struct Unit {
  WireStrided s;
  std::uint64_t bytes() const { return s.length * s.rows; }
};

std::vector<Unit> units_of(const RawOwner::Request& r) {
  std::vector<Unit> out;
  if ((r.hdr.flags & kReqStrided) != 0) {
    for (std::uint64_t i = 0; i < r.hdr.nspans; ++i) {
      WireStrided w;
      std::memcpy(&w, r.body.data() + i * sizeof w, sizeof w);
      out.push_back({w});
    }
  } else {
    for (std::uint64_t i = 0; i < r.hdr.nspans; ++i) {
      WireSpan w;
      std::memcpy(&w, r.body.data() + i * sizeof w, sizeof w);
      out.push_back({{w.remote_offset, w.length, w.local_offset, 1, 0, 0}});
    }
  }
  return out;
}

std::vector<std::uint8_t> bytes_of(const std::vector<Unit>& u, std::size_t first,
                                   std::size_t count) {
  std::vector<std::uint8_t> out;
  for (std::size_t k = first; k < first + count; ++k) {
    for (std::uint64_t r = 0; r < u[k].s.rows; ++r) {
      for (std::uint64_t b = 0; b < u[k].s.length; ++b) {
        out.push_back(owned(u[k].s.remote_offset + r * u[k].s.remote_stride + b));
      }
    }
  }
  return out;
}

struct ForgedCase {
  bool strided = false;
  bool staged = false;  // the reader's ucx_staging=on
};

class UcxForgedOwner : public ::testing::TestWithParam<ForgedCase> {
 protected:
  void SetUp() override {
    if (!ucx_test::ucx_built()) GTEST_SKIP() << "ucx engine not built";
    ucx_test::use_loopback_tcp();
    const bool strided = GetParam().strided;
    remote_ = testing::make_layout(2, 64, 16, 2, 64, DType::kBFloat16, CacheOrder::kLayerMajor,
                                   strided ? PageOrder::kHND : PageOrder::kNHD);
    local_ = testing::make_layout(2, 64, 16, 2, 64);
    for (std::uint32_t i = 0; i < kPages; ++i) {
      remote_pages_.push_back((i * 5 + 1) % 64);
      local_pages_.push_back((i * 7 + 3) % 64);
    }
  }

  // Reads kPages pages from an owner telling `lie`; returns the read's
  // status and leaves the units it asked for in units_.
  // `groups_of_16`: the honest owner sends groups of 16 units instead of
  // gather_groups' messages.
  Status read_from(Lie lie, bool groups_of_16 = false) {
    rma::RmaRegionInfo region;
    region.entity_id = "forger";
    region.data_ptr = 1u << 20;
    region.size = remote_.total_bytes();
    region.layout = remote_;
    region.generation = 77;
    RawOwner owner(
        region, [this, lie, groups_of_16](RawOwner& o, ucp_ep_h ep, const RawOwner::Request& r) {
          EXPECT_NE(r.hdr.flags & kReqGather, 0u) << "the test needs a gathered read";
          const std::vector<Unit> u = units_of(r);
          {
            std::lock_guard<std::mutex> lk(mu_);
            units_ = u;
          }
          auto group = [&](std::size_t first, std::size_t count, std::int64_t extra = 0) {
            std::vector<std::uint8_t> data = bytes_of(u, first, count);
            if (extra > 0) data.resize(data.size() + static_cast<std::size_t>(extra), 0x77);
            if (extra < 0) data.resize(data.size() - static_cast<std::size_t>(-extra));
            const GatherHdr h{r.hdr.batch_id, first, count, data.size()};
            o.send(ep, kAmGatherData, &h, sizeof h, data.data(), data.size());
          };
          const std::size_t n = u.size();
          switch (lie) {
            case Lie::kGroupBeyond:
              group(0, 8);
              group(n - 1, 1);
              {
                const GatherHdr h{r.hdr.batch_id, n, 1, 16};
                const std::vector<std::uint8_t> data(16, 0x77);
                o.send(ep, kAmGatherData, &h, sizeof h, data.data(), data.size());
              }
              return;
            case Lie::kGroupTwice:
              group(0, 8);
              group(0, 8);
              return;
            case Lie::kLengthTooLong:
              group(0, 8, 64);
              return;
            case Lie::kLengthTooShort:
              group(0, 8, -1);
              return;
            case Lie::kNone:
              if (groups_of_16) {
                for (std::size_t first = 0; first < n; first += 16) {
                  group(first, std::min<std::size_t>(16, n - first));
                }
                return;
              }
              for (const auto& [first, count] : gather_groups(
                       n, [&](std::size_t i) { return u[i].bytes(); },
                       [&](std::size_t i) { return u[i].s.rows; })) {
                group(first, count);
              }
              return;
          }
        });
    cache_ = make_kv_cache(local_, MemoryKind::kHost);
    std::memset(cache_->base(), static_cast<int>(kSentinel), cache_->size_bytes());
    EngineOptions o;
    o.timeout = 5000ms;
    if (GetParam().staged) o.extra["ucx_staging"] = "on";
    KVTransferManager m(TransferEngineInfo{"reader", "", "ucx", o}, cache_);
    auto f =
        m.start_async_retrieve(0, kPages * 16, local_pages_, remote_pages_, owner.descriptor());
    if (!f) return Status(StatusCode::kInternal, "no future");
    EXPECT_TRUE(f->wait_for(10s)) << "the read did not resolve";
    return f->status();
  }

  // Bytes of the local cache outside the rows the read asked for that are
  // not the sentinel, and rows asked for that do not hold the owner's bytes.
  std::pair<std::uint64_t, std::uint64_t> check_cache() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::uint8_t> named(cache_->size_bytes(), 0);
    std::uint64_t wrong_inside = 0;
    for (const Unit& u : units_) {
      for (std::uint64_t r = 0; r < u.s.rows; ++r) {
        for (std::uint64_t b = 0; b < u.s.length; ++b) {
          const std::uint64_t at = u.s.local_offset + r * u.s.local_stride + b;
          named[at] = 1;
          const auto want = owned(u.s.remote_offset + r * u.s.remote_stride + b);
          wrong_inside += static_cast<std::uint8_t>(cache_->base()[at]) != want;
        }
      }
    }
    std::uint64_t outside = 0;
    for (std::size_t i = 0; i < named.size(); ++i) {
      outside += !named[i] && cache_->base()[i] != kSentinel;
    }
    return {outside, wrong_inside};
  }

  static constexpr std::uint32_t kPages = 20;
  KVLayout remote_, local_;
  std::vector<std::uint32_t> remote_pages_, local_pages_;
  std::shared_ptr<KVCache> cache_;
  std::mutex mu_;
  std::vector<Unit> units_;
};

TEST_P(UcxForgedOwner, AnHonestGatheredReplyLandsWhereTheReadAsked) {
  const Status st = read_from(Lie::kNone);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_FALSE(units_.empty());
  if (GetParam().strided) {
    EXPECT_NE(units_.front().s.rows, 1u) << "expected strided spans on the wire";
  }
  const auto [outside, wrong] = check_cache();
  EXPECT_EQ(outside, 0u) << "bytes written outside the rows asked for";
  EXPECT_EQ(wrong, 0u) << "rows asked for do not hold the owner's bytes";
}

TEST_P(UcxForgedOwner, AGroupNotAskedForFailsTheRead) {
  for (const Lie lie :
       {Lie::kGroupBeyond, Lie::kGroupTwice, Lie::kLengthTooLong, Lie::kLengthTooShort}) {
    const Status st = read_from(lie);
    EXPECT_EQ(st.code(), StatusCode::kInternal) << static_cast<int>(lie) << ": " << st.to_string();
    EXPECT_NE(st.message().find("did not ask for"), std::string::npos) << st.to_string();
    EXPECT_EQ(check_cache().first, 0u)
        << static_cast<int>(lie) << ": bytes written outside the rows asked for";
  }
}

TEST_P(UcxForgedOwner, OtherHonestGroupsLandDirectlyAndAreRefusedStaged) {
  // Groups of 16 units are the read's bytes, each once: a direct reader
  // writes them where it asked; a staged reader has a buffer per message of
  // its own grouping only and refuses them, writing nothing.
  const Status st = read_from(Lie::kNone, /*groups_of_16=*/true);
  const auto [outside, wrong] = check_cache();
  EXPECT_EQ(outside, 0u) << "bytes written outside the rows asked for";
  if (!GetParam().staged) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(wrong, 0u);
    return;
  }
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.to_string();
  EXPECT_NE(st.message().find("not one of the messages this staged read receives"),
            std::string::npos)
      << st.to_string();
}

INSTANTIATE_TEST_SUITE_P(Spans, UcxForgedOwner,
                         ::testing::Values(ForgedCase{false, false}, ForgedCase{true, false},
                                           ForgedCase{false, true}, ForgedCase{true, true}),
                         [](const auto& p) {
                           return std::string(p.param.strided ? "strided" : "plain") +
                                  (p.param.staged ? "_staged" : "");
                         });

}  // namespace
}  // namespace mstar::kv::ucx
