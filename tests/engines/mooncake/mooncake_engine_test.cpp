// Copyright mstar-kv authors.
//
// The Mooncake engine against a real peer process running Mooncake's real
// transfer engine (TCP, P2P handshake, loopback). The library comes from
// MSTAR_KV_MOONCAKE_LIB; without it the tests that need Mooncake skip with
// the reason. The options and descriptor tests run everywhere.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/expectations.hpp"
#include "common/managers.hpp"
#include "common/peer_process.hpp"
#include "engines/mooncake/mooncake_test_util.hpp"
#include "engines/mooncake/read_error.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;
using testing::read_error;

using testing::count_changed;
using testing::iota_pages;
using testing::kSeed;
using testing::kSentinel;
using testing::mooncake_skip_reason;
using testing::written_outside;

KVLayout layout(std::uint32_t pages = 256) { return testing::mooncake_test_layout(pages); }

class MooncakeEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = mooncake_skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
  }

  static PeerSpec spec(const KVLayout& l, std::uint64_t tokens) {
    PeerSpec s;
    s.engine = "mooncake";
    s.layout = l;
    s.tokens = tokens;
    s.seed = kSeed;
    s.scatter_seed = 7;
    return s;
  }

  static std::shared_ptr<KVCache> cache(const KVLayout& l) { return testing::sentinel_cache(l); }

  static std::unique_ptr<KVTransferManager> manager(std::shared_ptr<KVCache> c,
                                                    std::chrono::milliseconds timeout = 5000ms,
                                                    std::map<std::string, std::string> extra = {}) {
    return testing::reader_manager("mooncake", std::move(c), timeout, std::move(extra));
  }
};

TEST_F(MooncakeEngine, SessionIdIsMooncakesHostAndPort) {
  auto c = cache(layout());
  MooncakeKVTransferEngine e(c, TransferEngineInfo{"me", "", "mooncake", {}});
  EXPECT_EQ(e.session_id().rfind("127.0.0.1:", 0), 0u) << e.session_id();
  const MooncakeKVTransferInfo info = MooncakeKVTransferInfo::decode(e.get_kv_transfer_info());
  EXPECT_EQ(info.entity_id, "me");
  EXPECT_EQ(info.session_id, e.session_id());
  EXPECT_EQ(info.data_ptr, reinterpret_cast<std::uintptr_t>(c->base()));
  EXPECT_EQ(info.size, c->size_bytes());
  EXPECT_EQ(info.layout, c->layout());
  EXPECT_NE(info.generation, 0u);
  EXPECT_EQ(MooncakeKVTransferInfo::decode(e.get_kv_transfer_info()), info);
  e.shutdown();
  e.shutdown();  // idempotent
}

TEST_F(MooncakeEngine, FullAndPartialPullsMoveExactlyTheNamedTokens) {
  const KVLayout l = layout();
  PeerProcess peer(spec(l, 1000));  // 63 pages, the last one partial
  const auto& seq = peer.sequence();
  auto c = cache(l);
  auto m = manager(c);
  const auto lp = iota_pages(seq.page_indices.size(), 100);
  // A prefix hit: tokens [0, 333) are already here; pull the rest.
  const std::uint64_t bytes =
      m->sync_retrieve(333, 1000, lp, seq.page_indices, seq.kv_transfer_info);
  EXPECT_EQ(bytes, (1000u - 333u) * l.token_bytes() * 2 * l.num_layers);
  auto v = verify_pattern(*c, kSeed, lp, 333, 1000);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  EXPECT_EQ(written_outside(*c, l, plan_reads(l, 333, 1000, lp, seq.page_indices)), 0u)
      << "bytes outside the read were written";
  // Then the prefix as well.
  m->sync_retrieve(0, 333, lp, seq.page_indices, seq.kv_transfer_info);
  v = verify_pattern(*c, kSeed, lp, 0, 1000);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_F(MooncakeEngine, AReadOfManyMoreRequestsThanMooncakesQueueSucceeds) {
  // 4096 scattered pages x 2 layers x k|v: 16384 separate 4 KiB requests,
  // 16x Mooncake's per-peer TCP queue; the engine must feed them in.
  const KVLayout l = layout(4096);
  PeerProcess peer(spec(l, 4096 * 16));
  const auto& seq = peer.sequence();
  auto c = cache(l);
  auto m = manager(c, 30000ms);
  std::vector<std::uint32_t> lp(seq.page_indices.size());
  for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>((i * 11) % 4096);
  m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  auto v = verify_pattern(*c, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_F(MooncakeEngine, ForgedDescriptorsAreRejectedBeforeAnyByteMoves) {
  const KVLayout l = layout();
  PeerProcess peer(spec(l, 64));
  const auto& seq = peer.sequence();
  auto c = cache(l);
  auto m = manager(c, 3000ms);
  const MooncakeKVTransferInfo good = MooncakeKVTransferInfo::decode(seq.kv_transfer_info);

  auto forged = [&](auto mutate) {
    MooncakeKVTransferInfo f = good;
    mutate(f);
    return f.encode();
  };
  struct Case {
    const char* what;
    KVTransferInfo info;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"stale generation", forged([](auto& f) { f.generation ^= 1; }),
       StatusCode::kStaleDescriptor},
      {"shifted data_ptr", forged([](auto& f) { f.data_ptr += 4096; }),
       StatusCode::kPermissionDenied},
      {"larger size", forged([](auto& f) { f.size += 4096; }), StatusCode::kPermissionDenied},
      {"other entity", forged([](auto& f) { f.entity_id = "mallory"; }),
       StatusCode::kInvalidArgument},
      {"forged identity page", forged([](auto& f) { f.identity_ptr = f.data_ptr; }),
       StatusCode::kPermissionDenied},
      {"unregistered identity page", forged([](auto& f) { f.identity_ptr = 0x1000; }),
       StatusCode::kPermissionDenied},
      {"nobody at the session id", forged([](auto& f) { f.session_id = "127.0.0.1:1"; }),
       StatusCode::kPeerFailure},
  };
  for (const Case& k : cases) {
    const Error e = read_error(*m, seq.page_indices, k.info);
    EXPECT_EQ(e.code(), k.code) << k.what << ": " << e.what();
  }
  EXPECT_EQ(count_changed(*c), 0u) << "a rejected descriptor wrote bytes";
  // The real one still works after all that.
  m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());
}

TEST_F(MooncakeEngine, DescriptorOfARestartedPeerIsRejected) {
  const KVLayout l = layout();
  auto c = cache(l);
  auto m = manager(c, 3000ms);
  PeerProcess first(spec(l, 64));
  const testing::DeadPeer dead = testing::read_then_kill(first, *m, 64, iota_pages(4));
  const KVTransferInfo& old = dead.descriptor;
  const std::vector<std::uint32_t>& pages = dead.pages;
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  PeerProcess second(spec(l, 64));
  // The engine still holds a connection to the dead owner: the read is either
  // rejected at once or its requests fail at Mooncake; no byte lands.
  bool failed = false;
  try {
    auto f = m->start_async_retrieve(0, 64, iota_pages(4), pages, old);
    ASSERT_TRUE(f.has_value());
    ASSERT_TRUE(f->wait_for(10s));
    failed = !f->status().is_ok();
  } catch (const Error&) {
    failed = true;
  }
  EXPECT_TRUE(failed) << "a descriptor of a dead owner was read";
  EXPECT_EQ(count_changed(*c), 0u);
  // Once that connection failed, the descriptor is rejected before submitting.
  const Error e = read_error(*m, pages, old);
  EXPECT_EQ(e.code(), StatusCode::kPeerFailure) << e.what();
  EXPECT_EQ(count_changed(*c), 0u);
  // And the new owner's own descriptor works.
  const auto& seq = second.sequence();
  m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());
}

TEST_F(MooncakeEngine, PeerKilledMidPullFailsWithinTheConfiguredTime) {
  const KVLayout l = layout(8192);  // 128 MiB: long enough to die during
  PeerProcess peer(spec(l, 8192 * 16));
  const auto& seq = peer.sequence();
  auto c = make_kv_cache(l, MemoryKind::kHost);
  auto m = manager(c, 2000ms);
  const auto lp = iota_pages(seq.page_indices.size());
  auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  std::this_thread::sleep_for(20ms);
  const auto t0 = std::chrono::steady_clock::now();
  peer.kill_now();
  ASSERT_TRUE(f->wait_for(2000ms + 2000ms + 3s)) << "no resolution after the peer died";
  const auto took = std::chrono::steady_clock::now() - t0;
  if (f->status().is_ok()) {
    auto v = verify_pattern(*c, kSeed, lp, 0, seq.num_tokens);
    EXPECT_TRUE(v.ok()) << "success reported with wrong bytes: " << v.first_mismatch;
  } else {
    const StatusCode code = f->status().code();
    EXPECT_TRUE(code == StatusCode::kPeerFailure || code == StatusCode::kTimeout)
        << f->status().to_string();
  }
  std::printf(
      "peer killed: future resolved %lld ms later: %s\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      f->status().to_string().c_str());
}

TEST_F(MooncakeEngine, HungPeerCostsTheEngineNeverALateWrite) {
  const KVLayout l = layout(8192);
  PeerProcess peer(spec(l, 8192 * 16));
  const auto& seq = peer.sequence();
  auto c = cache(l);
  auto m = manager(c, 1000ms, {{"mooncake_abort_grace_ms", "500"}});
  const auto lp = iota_pages(seq.page_indices.size());
  auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(::kill(peer.pid(), SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  // timeout 1 s + grace 0.5 s + destroying Mooncake's engine (~1 s).
  const bool resolved = f->wait_for(8s);
  ::kill(peer.pid(), SIGCONT);
  ASSERT_TRUE(resolved) << "the read of a hung peer never resolved";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  if (f->status().is_ok()) {
    GTEST_SKIP() << "the 256 MiB read finished before SIGSTOP took effect";
  }
  EXPECT_EQ(f->status().code(), StatusCode::kTimeout) << f->status().to_string();
  // Nothing lands after the resolution, even once the peer runs again.
  std::vector<std::byte> snapshot(c->base(), c->base() + c->size_bytes());
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(std::memcmp(snapshot.data(), c->base(), snapshot.size()), 0)
      << "bytes landed after the future resolved";
  // The engine was torn down: it says so instead of hanging again.
  testing::expect_error(
      [&] { m->start_async_retrieve(0, 16, iota_pages(1), iota_pages(1), seq.kv_transfer_info); },
      StatusCode::kUnavailable, {"hangs"});
}

// ---- everywhere: no Mooncake needed ------------------------------------------

TEST(MooncakeEngineAnywhere, AbsentLibraryIsUnavailableNamingThePath) {
  EngineOptions o;
  o.extra["mooncake_lib"] = "/no/such/libtransfer_engine.so";
  testing::expect_error(
      [&] {
        KVTransferManager m(TransferEngineInfo{"me", "", "mooncake", o},
                            make_kv_cache(layout(), MemoryKind::kHost));
      },
      StatusCode::kUnavailable, {"/no/such/libtransfer_engine.so"});
}

EngineOptions with_extra(std::map<std::string, std::string> extra) {
  EngineOptions o;
  o.extra = std::move(extra);
  return o;
}

TEST(MooncakeEngineAnywhere, OptionsAreCheckedByName) {
  EXPECT_EQ(MooncakeOptions::parse(with_extra({})).metadata, "P2PHANDSHAKE");
  EXPECT_EQ(MooncakeOptions::parse(with_extra({{"ucx_tls", "tcp"}})).protocol, "tcp");
  const auto o = MooncakeOptions::parse(
      with_extra({{"mooncake_lib", "/x.so"}, {"mooncake_abort_grace_ms", "250"}}));
  EXPECT_EQ(o.library_path, "/x.so");
  EXPECT_EQ(o.abort_grace_ms, 250u);
  for (const auto& [k, v] : std::map<std::string, std::string>{{"mooncake_libb", "/x.so"},
                                                               {"mooncake_abort_grace_ms", "0"},
                                                               {"mooncake_abort_grace_ms", "12x"},
                                                               {"mooncake_protocol", ""}}) {
    testing::expect_error(
        [&] {
          MooncakeOptions::parse(with_extra({{k, v}}));
        },
        StatusCode::kInvalidArgument);
  }
}

TEST(MooncakeEngineAnywhere, DescriptorRoundTripsAndRejectsUntrustedBytes) {
  MooncakeKVTransferInfo d;
  d.entity_id = "prefill-0";
  d.session_id = "10.0.0.7:15123";
  d.data_ptr = 0x7f0000000000;
  d.layout = layout();
  d.size = d.layout.total_bytes();
  d.generation = 42;
  d.identity_ptr = 0x7f1000000000;
  d.epochs_ptr = 0x7f1000100000;
  d.ready_ptr = 0x7f1000200000;
  const KVTransferInfo info = d.encode();
  EXPECT_EQ(info.engine, "mooncake");
  EXPECT_EQ(MooncakeKVTransferInfo::decode(info), d);
  // Through the framed, checksummed bytes as well.
  EXPECT_EQ(MooncakeKVTransferInfo::decode(KVTransferInfo::decode(info.encode())), d);

  for (std::size_t n = 0; n < info.payload.size(); ++n) {
    KVTransferInfo cut = info;
    cut.payload.resize(n);
    testing::expect_error([&] { MooncakeKVTransferInfo::decode(cut); },
                          StatusCode::kCorruptDescriptor);
  }
  auto bad = [&](auto mutate) {
    MooncakeKVTransferInfo f = d;
    mutate(f);
    try {
      MooncakeKVTransferInfo::decode(f.encode());
      return std::string("accepted");
    } catch (const Error& e) {
      return std::string(to_string(e.code())) + ": " + e.what();
    }
  };
  EXPECT_NE(bad([](auto& f) { f.generation = 0; }).find("CorruptDescriptor"), std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.size = 4096; }).find("CorruptDescriptor"), std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.data_ptr = ~0ull - 10; }).find("CorruptDescriptor"),
            std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.identity_ptr = 0; }).find("identity_ptr"), std::string::npos);
  // The page epoch table's address is untrusted too: null, unaligned, or
  // running past the end of the address space.
  EXPECT_NE(bad([](auto& f) { f.epochs_ptr = 0; }).find("epochs_ptr"), std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.epochs_ptr = 0x7f1000100004; }).find("epochs_ptr"),
            std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.epochs_ptr = ~0ull - 7; }).find("epochs_ptr"), std::string::npos);
  // So is the readiness words' (streaming readers poll them).
  EXPECT_NE(bad([](auto& f) { f.ready_ptr = 0; }).find("ready_ptr"), std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.ready_ptr = 0x7f1000200002; }).find("ready_ptr"),
            std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.ready_ptr = ~0ull - 3; }).find("ready_ptr"), std::string::npos);
  EXPECT_NE(bad([](auto& f) { f.session_id.clear(); }).find("session_id"), std::string::npos);
  KVTransferInfo other = info;
  other.engine = "ucx";
  EXPECT_THROW(MooncakeKVTransferInfo::decode(other), Error);
}

}  // namespace
}  // namespace mstar::kv
