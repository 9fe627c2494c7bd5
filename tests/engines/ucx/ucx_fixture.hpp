// Copyright mstar-kv authors.
//
// The ucx engine tests' fixture: one case per UCX transport and read mode,
// real peer processes (kv_conformance_peer) on loopback, caches filled with
// a sentinel, and the cases every suite is instantiated over.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "common/peer_process.hpp"
#include "mstar/kv/engines/ucx.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::ucx_test {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;

struct UcxCase {
  std::string label;
  std::string tls;    // UCX_TLS
  std::string mode;   // ucx_mode
  std::string proto;  // ucx_am_proto ("" = default)
  // Why kill -9 of an owner is not tested ("" = it is): see ucx.hpp.
  std::string no_kill = "";
};
inline void PrintTo(const UcxCase& c, std::ostream* os) { *os << c.label; }

constexpr std::byte kSentinel{0xA5};
constexpr std::uint64_t kSeed = 99;

inline KVLayout layout(std::uint32_t pages = 64, CacheOrder co = CacheOrder::kLayerMajor,
                       PageOrder po = PageOrder::kNHD) {
  return testing::small_layout(pages, co, po);
}
using testing::iota_pages;
using testing::small_layout;

// Whether this build has the ucx engine (the suites skip without it).
inline bool ucx_built() {
  const auto b = built_engines();
  return std::find(b.begin(), b.end(), "ucx") != b.end();
}

// UCX over TCP on loopback only: the suites that hold a backend or talk to
// raw UCX peers themselves.
inline void use_loopback_tcp() {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
}

class UcxFixture : public ::testing::TestWithParam<UcxCase> {
 protected:
  void SetUp() override {
    if (!ucx_built()) GTEST_SKIP() << "ucx engine not built";
    for (const auto& [k, v] : env()) ::setenv(k.c_str(), v.c_str(), 1);
  }

  std::map<std::string, std::string> env() const {
    // REUSEADDR: a new owner listens where an old one did (see ucx.hpp).
    return {{"UCX_TLS", GetParam().tls}, {"UCX_NET_DEVICES", "lo"}, {"UCX_TCP_CM_REUSEADDR", "y"}};
  }
  std::map<std::string, std::string> extra() const {
    std::map<std::string, std::string> e{{"ucx_mode", GetParam().mode}};
    if (!GetParam().proto.empty()) e["ucx_am_proto"] = GetParam().proto;
    // Gets on loopback are UCX's emulation, which an owner serves only when
    // asked (ucx_emulated_gets; the refusal: ucx_get_refusal_test.cpp).
    if (GetParam().mode == "get") e["ucx_emulated_gets"] = "on";
    return e;
  }

  PeerSpec spec(const KVLayout& l, std::uint64_t tokens, std::uint64_t scatter = 7) const {
    PeerSpec s;
    s.engine = "ucx";
    s.layout = l;
    s.tokens = tokens;
    s.seed = kSeed;
    s.scatter_seed = scatter;
    s.env = env();
    s.extra = extra();
    return s;
  }

  // A reader over this case's transport; `more` adds or overrides options.
  std::unique_ptr<KVTransferManager> manager(std::shared_ptr<KVCache> cache,
                                             std::chrono::milliseconds timeout = 5000ms,
                                             const std::map<std::string, std::string>& more = {}) {
    EngineOptions o;
    o.timeout = timeout;
    o.extra = extra();
    for (const auto& [k, v] : more) o.extra[k] = v;
    return std::make_unique<KVTransferManager>(TransferEngineInfo{"decode", "", "ucx", o},
                                               std::move(cache));
  }

  static std::shared_ptr<KVCache> local_cache(const KVLayout& l) {
    auto c = make_kv_cache(l, MemoryKind::kHost);
    std::memset(c->base(), static_cast<int>(kSentinel), l.total_bytes());
    return c;
  }

  static bool untouched(const KVCache& c) {
    const auto* p = c.base();
    return std::all_of(p, p + c.size_bytes(), [](std::byte b) { return b == kSentinel; });
  }

  // After their peer died: every future resolves within 10 s, each failure
  // kPeerFailure or kTimeout. True when any failed.
  static bool any_failed_after_peer_death(std::vector<TransferFuture>& fs) {
    bool any_failed = false;
    for (auto& f : fs) {
      EXPECT_TRUE(f.wait_for(std::chrono::seconds(10))) << "no resolution after the peer died";
      if (f.ready() && !f.status().is_ok()) {
        any_failed = true;
        EXPECT_TRUE(f.status().code() == StatusCode::kPeerFailure ||
                    f.status().code() == StatusCode::kTimeout)
            << f.status().to_string();
      }
    }
    return any_failed;
  }
};

// Every transport and read mode the engine has on loopback.
inline auto ucx_cases() {
  return ::testing::Values(
      UcxCase{"tcp_auto", "tcp", "auto", ""}, UcxCase{"tcp_am_eager", "tcp", "am", "eager"},
      UcxCase{"tcp_get", "tcp", "get", ""}, UcxCase{"shm_auto", "sm,self,tcp", "auto", ""},
      UcxCase{"shm_am_shm", "sm,self,tcp", "am_shm", "",
              "UCX 1.13 shared-memory endpoints have no peer error handling: a killed "
              "owner can stall the reader's fifo (documented in ucx.hpp)"},
      UcxCase{"shm_get", "sm,self,tcp", "get", "",
              "UCX 1.13 shared-memory endpoints have no peer error handling: a killed "
              "owner can stall the reader's fifo (documented in ucx.hpp)"});
}

inline std::string case_name(const ::testing::TestParamInfo<UcxCase>& i) { return i.param.label; }

}  // namespace mstar::kv::ucx_test
