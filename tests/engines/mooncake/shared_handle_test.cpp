// Copyright mstar-kv authors.
//
// The Mooncake engine on the application's own Mooncake engine handle (the
// spec's MooncakeKVTransferEngine(kv_cache, entity_id, transfer_engine)),
// against a peer process that does the same (mooncake_shared_peer). Needs
// Mooncake's library in MSTAR_KV_MOONCAKE_LIB, else skips with the reason;
// the argument checks run everywhere.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/peer.hpp"
#include "common/wire.hpp"
#include "engines/mooncake/mooncake_test_util.hpp"
#include "engines/mooncake/read_error.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

#ifndef MSTAR_KV_SHARED_PEER_PATH
#error "MSTAR_KV_SHARED_PEER_PATH must name the mooncake_shared_peer executable"
#endif
#ifndef MSTAR_KV_TEST_PARTIAL_LIB
#error "MSTAR_KV_TEST_PARTIAL_LIB must name the partial stand-in library"
#endif

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::AppMooncake;
using testing::count_changed;
using testing::iota_pages;
using testing::kSeed;
using testing::kSentinel;
using testing::read_error;
using testing::sentinel_cache;

KVLayout layout(std::uint32_t pages = 256) { return testing::mooncake_test_layout(pages); }

// mooncake_shared_peer: an application with its own Mooncake engine serving
// one sequence through a shared-handle MooncakeKVTransferEngine.
class SharedPeer : public testing::Peer {
 public:
  SharedPeer(const KVLayout& l, std::uint64_t tokens)
      : Peer({MSTAR_KV_SHARED_PEER_PATH, "--layout", testing::layout_arg(l), "--tokens",
              std::to_string(tokens), "--seed", std::to_string(kSeed), "--scatter", "7"},
             {}, 30s) {}
  // Its engine is replaced by a new one on the same handle and cache.
  void restart() { command("restart", 30s); }
};

class MooncakeSharedHandle : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::mooncake_skip_reason();
    if (!why.empty()) GTEST_SKIP() << why;
    lib_ = std::getenv("MSTAR_KV_MOONCAKE_LIB");
  }

  // A manager around a shared-handle engine on `handle`.
  static std::unique_ptr<KVTransferManager> manager(std::shared_ptr<KVCache> c,
                                                    MooncakeEngineHandle handle,
                                                    std::chrono::milliseconds timeout = 5000ms,
                                                    std::map<std::string, std::string> extra = {}) {
    EngineOptions o;
    o.timeout = timeout;
    o.extra = std::move(extra);
    auto e = std::make_unique<MooncakeKVTransferEngine>(c, "decode", handle, o);
    return std::make_unique<KVTransferManager>(std::move(c), std::move(e));
  }

  std::string lib_;
};

TEST_F(MooncakeSharedHandle, SharedHandlesInTwoProcessesPullEveryByte) {
  const KVLayout l = layout();
  SharedPeer peer(l, 1000);  // 63 pages, the last one partial
  const auto& seq = peer.sequence();
  AppMooncake app(lib_);
  auto c = sentinel_cache(l);
  EngineOptions o;
  o.timeout = 3000ms;
  auto e = std::make_unique<MooncakeKVTransferEngine>(c, "decode", app.handle(), o);
  // The session is the application's engine's.
  EXPECT_EQ(e->session_id(), app.ip_port());
  EXPECT_EQ(MooncakeKVTransferInfo::decode(e->get_kv_transfer_info()).session_id, app.ip_port());
  EXPECT_EQ(MooncakeKVTransferInfo::decode(e->get_kv_transfer_info()).data_ptr,
            reinterpret_cast<std::uintptr_t>(c->base()));
  KVTransferManager m(c, std::move(e));

  // Forged descriptors are refused via the peer's identity page first.
  const MooncakeKVTransferInfo good = MooncakeKVTransferInfo::decode(seq.kv_transfer_info);
  auto forged = [&](auto mutate) {
    MooncakeKVTransferInfo f = good;
    mutate(f);
    return f.encode();
  };
  EXPECT_EQ(read_error(m, seq.page_indices, forged([](auto& f) { f.generation ^= 1; })).code(),
            StatusCode::kStaleDescriptor);
  EXPECT_EQ(read_error(m, seq.page_indices, forged([](auto& f) { f.data_ptr += 4096; })).code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(
      read_error(m, seq.page_indices, forged([](auto& f) { f.identity_ptr = f.data_ptr; })).code(),
      StatusCode::kPermissionDenied);
  EXPECT_EQ(count_changed(*c), 0u) << "a rejected descriptor wrote bytes";

  // A prefix hit first, then the prefix: every byte of the sequence.
  const auto lp = iota_pages(seq.page_indices.size(), 100);
  const std::uint64_t bytes =
      m.sync_retrieve(333, 1000, lp, seq.page_indices, seq.kv_transfer_info);
  EXPECT_EQ(bytes, (1000u - 333u) * l.token_bytes() * 2 * l.num_layers);
  EXPECT_EQ(testing::written_outside(*c, l, plan_reads(l, 333, 1000, lp, seq.page_indices)), 0u)
      << "bytes outside the read were written";
  m.sync_retrieve(0, 333, lp, seq.page_indices, seq.kv_transfer_info);
  const auto v = verify_pattern(*c, kSeed, lp, 0, 1000);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_F(MooncakeSharedHandle, TheApplicationsHandleOutlivesItsEngines) {
  const KVLayout l = layout();
  SharedPeer peer(l, 64);
  AppMooncake app(lib_);
  auto c = sentinel_cache(l);
  {
    auto m = manager(c, app.handle());
    m->sync_retrieve(0, 64, iota_pages(4), peer.sequence().page_indices,
                     peer.sequence().kv_transfer_info);
    EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());
    m->cleanup();
  }
  // A second engine on the same handle and cache: registering the cache
  // again works only because the first engine unregistered it (and did not
  // destroy the handle), and the handle still moves bytes.
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  auto m = manager(c, app.handle());
  m->sync_retrieve(0, 64, iota_pages(4), peer.sequence().page_indices,
                   peer.sequence().kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());

  // The peer replaces its engine on its own handle and cache; the new
  // descriptor reads, the old one is refused and writes nothing.
  const KVTransferInfo old = peer.sequence().kv_transfer_info;
  peer.restart();
  const auto& seq = peer.sequence();
  EXPECT_NE(MooncakeKVTransferInfo::decode(seq.kv_transfer_info).generation,
            MooncakeKVTransferInfo::decode(old).generation);
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  const Error e = read_error(*m, seq.page_indices, old);
  EXPECT_TRUE(e.code() == StatusCode::kStaleDescriptor || e.code() == StatusCode::kPeerFailure)
      << e.what();
  EXPECT_EQ(count_changed(*c), 0u) << "the old descriptor wrote bytes";
  m->cleanup();
}

TEST_F(MooncakeSharedHandle, HungPeerNeverLandsALateByteAndSparesTheHandle) {
  const KVLayout l = layout(8192);  // 128 MiB
  SharedPeer peer(l, 8192 * 16);
  const auto& seq = peer.sequence();
  AppMooncake app(lib_);
  auto c = sentinel_cache(l);
  auto m = manager(c, app.handle(), 1000ms, {{"mooncake_abort_grace_ms", "500"}});
  const auto lp = iota_pages(seq.page_indices.size());
  auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(::kill(peer.pid(), SIGSTOP), 0);
  struct Resume {  // the peer runs again whatever happens below
    pid_t pid;
    ~Resume() { ::kill(pid, SIGCONT); }
  } resume{peer.pid()};
  // Past timeout (1 s) + grace (0.5 s) with bytes still owed: the future
  // stays unresolved, since the handle is not ours to destroy.
  if (f->wait_for(3s)) {
    if (f->status().is_ok()) GTEST_SKIP() << "the 128 MiB read finished before SIGSTOP";
    FAIL() << "the read of a hung peer resolved while its bytes could still land: "
           << f->status().to_string();
  }
  // The engine takes no new reads, and says why.
  try {
    m->start_async_retrieve(0, 16, iota_pages(1), iota_pages(1), seq.kv_transfer_info);
    ADD_FAILURE() << "a dead engine accepted a read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find("hangs"), std::string::npos) << e.what();
  }
  // Shutdown waits for the hung read too.
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    m->cleanup();
    closed = true;
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(closed.load()) << "shutdown returned while Mooncake still owed bytes";
  // The peer resumes: Mooncake finishes what it was given, then (only then)
  // the future resolves, and nothing lands afterwards.
  ::kill(peer.pid(), SIGCONT);
  const bool resolved = f->wait_for(20s);
  closer.join();
  ASSERT_TRUE(resolved) << "the read never resolved after the peer resumed";
  EXPECT_TRUE(closed.load());
  EXPECT_EQ(f->status().code(), StatusCode::kTimeout) << f->status().to_string();
  std::vector<std::byte> snapshot(c->base(), c->base() + c->size_bytes());
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(std::memcmp(snapshot.data(), c->base(), snapshot.size()), 0)
      << "bytes landed after the future resolved";
  // The application's engine was spared: a new engine on it reads again.
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  auto m2 = manager(c, app.handle());
  m2->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*c, kSeed, iota_pages(4), 0, 64).ok());
}

TEST_F(MooncakeSharedHandle, AnotherCopyOfMooncakesCApiInTheProcessIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // In a child process: a stand-in exporting createTransferEngine in the
  // global scope stands for an application linked against another copy.
  EXPECT_EXIT(
      {
        AppMooncake app(lib_);
        if (::dlopen(MSTAR_KV_TEST_PARTIAL_LIB, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
          std::fprintf(stderr, "dlopen of the stand-in failed\n");
          std::_Exit(3);
        }
        try {
          MooncakeKVTransferEngine e(sentinel_cache(layout()), "x", app.handle());
          std::fprintf(stderr, "accepted\n");
          std::_Exit(1);
        } catch (const Error& err) {
          std::fprintf(stderr, "%s\n", err.what());
          std::_Exit(err.code() == StatusCode::kInvalidArgument &&
                             std::strstr(err.what(), MSTAR_KV_TEST_PARTIAL_LIB) != nullptr
                         ? 0
                         : 2);
        }
      },
      ::testing::ExitedWithCode(0), "already has Mooncake's C API loaded from");
}

// ---- everywhere: no Mooncake needed ------------------------------------------

TEST(MooncakeSharedHandleAnywhere, BadArgumentsAreRejectedNamingTheValue) {
  auto c = make_kv_cache(layout(), MemoryKind::kHost);
  auto error = [](auto make) {
    try {
      make();
    } catch (const Error& e) {
      return e;
    }
    return Error(StatusCode::kOk, "accepted");
  };
  // Null handle: refused before any library is loaded.
  Error e = error([&] { MooncakeKVTransferEngine x(c, "me", nullptr); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  EXPECT_NE(std::string(e.what()).find("transfer_engine is null (0x0)"), std::string::npos)
      << e.what();
  // A handle that is never touched: every check below fails first (and the
  // library path does not exist, so nothing could call into it anyway).
  void* const never_used = reinterpret_cast<void*>(0x1);
  EngineOptions o;
  o.extra["mooncake_lib"] = "/no/such/libtransfer_engine.so";
  e = error([&] { MooncakeKVTransferEngine x(nullptr, "me", never_used, o); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  EXPECT_NE(std::string(e.what()).find("needs a KV cache"), std::string::npos) << e.what();
  for (const char* key : {"mooncake_metadata", "mooncake_host", "mooncake_protocol"}) {
    EngineOptions bad = o;
    bad.extra[key] = "etcd://10.0.0.1:2379";
    e = error([&] { MooncakeKVTransferEngine x(c, "me", never_used, bad); });
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << key << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(std::string("'") + key + "' = 'etcd://10.0.0.1:2379'"),
              std::string::npos)
        << e.what();
  }
  // mooncake_session_id belongs to the shared mode only.
  EngineOptions own = o;
  own.extra["mooncake_session_id"] = "10.0.0.7:1234";
  e = error([&] { MooncakeKVTransferEngine x(c, TransferEngineInfo{"me", "", "mooncake", own}); });
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  EXPECT_NE(std::string(e.what()).find("'mooncake_session_id' = '10.0.0.7:1234'"),
            std::string::npos)
      << e.what();
  EXPECT_EQ(MooncakeOptions::parse(own, /*shared_handle=*/true).session_id, "10.0.0.7:1234");
  // With valid arguments the missing library is what fails, naming the path.
  e = error([&] { MooncakeKVTransferEngine x(c, "me", never_used, o); });
  EXPECT_EQ(e.code(), StatusCode::kUnavailable) << e.what();
  EXPECT_NE(std::string(e.what()).find("/no/such/libtransfer_engine.so"), std::string::npos)
      << e.what();
}

}  // namespace
}  // namespace mstar::kv
