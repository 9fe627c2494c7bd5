// Copyright mstar-kv authors.
//
// The ucx engine against real peer processes (kv_conformance_peer), over
// UCX's tcp transport and its shared-memory transports on loopback, in both
// read modes: big and partial pulls, forged descriptors, a peer killed in
// the middle of a pull, shutdown with reads in flight.
#include <unistd.h>
#include <functional>
#include <thread>

#include "common/expectations.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "ucx_fixture.hpp"

namespace mstar::kv::ucx_test {
namespace {

class UcxEngine : public UcxFixture {};

TEST_P(UcxEngine, BigScatteredPullMovesEveryByte) {
  const KVLayout l = small_layout(2048);  // 64 MiB, scattered pages on both sides
  PeerProcess peer(spec(l, 2048 * 16));
  auto cache = local_cache(l);
  auto m = manager(cache, 20000ms);
  const auto& seq = peer.sequence();
  std::vector<std::uint32_t> lp = iota_pages(seq.page_indices.size());
  std::reverse(lp.begin(), lp.end());
  EXPECT_EQ(m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info),
            l.total_bytes());
  const auto v = verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

// Caches of one region per layer (vLLM's per-layer tensors) on either side,
// in every mode: the owner registers and sends from each layer's region
// (gets: one remote key per region), the reader lands each span in its own
// layer's region; whole pulls, a prefix hit, an in-page order change (rows
// gathered or, over gets, posted one by one) and a single-region reader.
TEST_P(UcxEngine, LayerSplitCachesPullByteExact) {
  const KVLayout remote = small_layout(256);
  PeerSpec s = spec(remote, 256 * 16);
  s.setup.layer_regions = true;
  PeerProcess peer(s);
  const auto& seq = peer.sequence();
  ASSERT_EQ(UcxKVTransferInfo::decode(seq.kv_transfer_info).layer_regions.size(),
            remote.num_layers);
  std::vector<std::uint32_t> lp = iota_pages(seq.page_indices.size());
  std::reverse(lp.begin(), lp.end());
  for (auto po : {PageOrder::kNHD, PageOrder::kHND}) {
    for (bool split : {true, false}) {
      SCOPED_TRACE(std::string(to_string(po)) + (split ? " split reader" : " one region"));
      const KVLayout local = small_layout(256, CacheOrder::kLayerMajor, po);
      auto cache =
          split ? KVCache::create_host_layers(local) : make_kv_cache(local, MemoryKind::kHost);
      testing::fill_bytes(*cache, kSentinel);
      auto m = manager(cache, 20000ms);
      m->sync_retrieve(40, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
      const auto reads = plan_reads(local, remote, 40, seq.num_tokens, lp, seq.page_indices);
      EXPECT_EQ(testing::bytes_written_outside(*cache, remote, reads, kSentinel), 0u);
      EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 40, seq.num_tokens).ok());
      m->sync_retrieve(0, 40, lp, seq.page_indices, seq.kv_transfer_info);
      EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens).ok());
    }
  }
}

// A split owner's descriptor as untrusted input: its layer regions are
// checked when decoded (count, overlaps, data_ptr) and against what the
// owner registered (addresses), before any byte moves.
TEST_P(UcxEngine, ForgedLayerRegionsAreRejectedBeforeAnyRead) {
  if (GetParam().label != "tcp_auto" && GetParam().label != "tcp_get") {
    GTEST_SKIP() << "the descriptor checks do not depend on the transport: tcp cases only";
  }
  const KVLayout l = small_layout(64);
  PeerSpec s = spec(l, 64);
  s.setup.layer_regions = true;
  PeerProcess peer(s);
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  const auto good = UcxKVTransferInfo::decode(seq.kv_transfer_info);
  ASSERT_EQ(good.layer_regions.size(), 4u);
  const std::uint64_t lb = l.layer_bytes();
  struct Case {
    const char* what;
    std::function<void(UcxKVTransferInfo&)> edit;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"two regions for four layers", [](auto& f) { f.layer_regions.resize(2); },
       StatusCode::kCorruptDescriptor, "2 layer regions"},
      {"overlapping regions", [lb](auto& f) { f.layer_regions[2] = f.layer_regions[1] + lb / 2; },
       StatusCode::kCorruptDescriptor, "overlaps"},
      {"data_ptr elsewhere", [](auto& f) { f.data_ptr += 4096; }, StatusCode::kCorruptDescriptor,
       "data_ptr at layer 0's region"},
      {"regions the owner did not register",
       [](auto& f) { std::swap(f.layer_regions[1], f.layer_regions[3]); },
       StatusCode::kPermissionDenied, "layer regions"},
      {"one region claimed", [](auto& f) { f.layer_regions.clear(); },
       StatusCode::kPermissionDenied, "layer regions"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto f = good;
    c.edit(f);
    testing::expect_error(
        [&] { m->start_async_retrieve(0, 64, iota_pages(4), seq.page_indices, f.encode()); },
        c.code, {c.says});
    EXPECT_TRUE(untouched(*cache));
  }
  m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, iota_pages(4), 0, 64).ok());
}

// ucx_progress: however the progress threads wait when idle (both sides the
// same, then each against the other), every byte arrives, in a large
// scattered pull and in small ones whose replies come while a side sleeps.
TEST_P(UcxEngine, EveryProgressPolicyPullsEveryByte) {
  const KVLayout big = small_layout(512);
  for (const char* owner_policy : {"adaptive", "busy", "event"}) {
    PeerSpec s = spec(big, 512 * 16);
    s.extra["ucx_progress"] = owner_policy;
    PeerProcess peer(s);
    const auto& seq = peer.sequence();
    for (const char* reader_policy : {"adaptive", "busy", "event"}) {
      SCOPED_TRACE(std::string("owner ") + owner_policy + ", reader " + reader_policy);
      auto cache = local_cache(big);
      auto m = manager(cache, 20000ms, {{"ucx_progress", reader_policy}});
      std::vector<std::uint32_t> lp = iota_pages(seq.page_indices.size());
      std::reverse(lp.begin(), lp.end());
      EXPECT_EQ(m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info),
                big.total_bytes());
      EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens).ok());
      for (int small = 0; small < 20; ++small) {  // one page of 4 layers, then idle a while
        const std::uint64_t end = 16u * static_cast<std::uint64_t>(small + 1);
        m->sync_retrieve(end - 16, end, lp, seq.page_indices, seq.kv_transfer_info);
        if (small % 5 == 0) std::this_thread::sleep_for(5ms);
      }
      EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens).ok());
    }
  }
}

TEST_P(UcxEngine, PartialPagesInEveryOrderTouchOnlyTheirTokens) {
  for (auto co : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage}) {
    for (auto po : {PageOrder::kNHD, PageOrder::kHND}) {
      const KVLayout remote = small_layout(64);
      const KVLayout local = small_layout(32, co, po);
      PeerProcess peer(spec(remote, 100));  // 7 pages, the last one partial
      auto cache = local_cache(local);
      auto m = manager(cache);
      const auto& seq = peer.sequence();
      const std::vector<std::uint32_t> lp{31, 3, 17, 5, 9, 20, 11};
      // A prefix of 21 tokens is "cached": pages 0 and 1 are clipped.
      m->sync_retrieve(21, 100, lp, seq.page_indices, seq.kv_transfer_info);
      const auto v = verify_pattern(*cache, kSeed, lp, 21, 100);
      EXPECT_TRUE(v.ok()) << to_string(co) << "/" << to_string(po) << ": " << v.first_mismatch;
      // Tokens [0, 21) and [100, 112) of those pages, and every other page,
      // still hold the sentinel.
      for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) {
        for (KV kv : {KV::kKey, KV::kValue}) {
          const auto b0 = cache->block(layer, kv, lp[0]);
          const auto row = local.token_bytes();
          if (po == PageOrder::kNHD) {
            EXPECT_TRUE(std::all_of(b0.begin(), b0.begin() + 16 * row,
                                    [](std::byte x) { return x == kSentinel; }));
            const auto b6 = cache->block(layer, kv, lp[6]);
            EXPECT_TRUE(std::all_of(b6.begin() + 4 * row, b6.end(),
                                    [](std::byte x) { return x == kSentinel; }));
          }
          const auto other = cache->block(layer, kv, 0);
          EXPECT_TRUE(
              std::all_of(other.begin(), other.end(), [](std::byte x) { return x == kSentinel; }));
        }
      }
    }
  }
}

TEST_P(UcxEngine, ForgedDescriptorsAreRejectedBeforeAnyRead) {
  const KVLayout l = small_layout(64);
  PeerProcess peer(spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = peer.sequence();
  const auto good = UcxKVTransferInfo::decode(seq.kv_transfer_info);
  auto expect_rejected = [&](UcxKVTransferInfo forged, StatusCode code, const char* what) {
    try {
      auto f = m->start_async_retrieve(0, 64, iota_pages(4), seq.page_indices, forged.encode());
      ADD_FAILURE() << what << ": accepted";
      if (f) f->wait_for(5s);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    }
    EXPECT_TRUE(untouched(*cache)) << what << ": bytes moved";
  };
  {
    auto f = good;
    for (auto& b : f.rkey) b = static_cast<std::uint8_t>(b ^ 0x5a);
    // An owner that serves no gets publishes no key (ucx_emulated_gets):
    // then a descriptor that claims one is the forgery.
    if (f.rkey.empty()) f.rkey.assign(16, 0x5a);
    expect_rejected(f, StatusCode::kPermissionDenied, "forged rkey bytes");
  }
  {
    auto f = good;
    f.data_ptr += 4096;
    expect_rejected(f, StatusCode::kPermissionDenied, "address outside the region");
  }
  {
    auto f = good;
    f.data_ptr = 0x1000;
    expect_rejected(f, StatusCode::kPermissionDenied, "address of another region");
  }
  {
    auto f = good;
    f.generation += 1;
    expect_rejected(f, StatusCode::kStaleDescriptor, "stale generation");
  }
  {
    auto f = good;
    f.layout.cache_order = CacheOrder::kPageMajor;  // the planner accepts it; the owner does not
    expect_rejected(f, StatusCode::kIncompatibleLayout, "wrong layout (cache order)");
  }
  {
    auto f = good;
    f.layout.num_pages = 63;  // claims a slightly smaller cache
    testing::expect_error(
        [&] {
          const std::vector<std::uint32_t> rp{0, 1, 2, 3};
          m->start_async_retrieve(0, 64, iota_pages(4), rp, f.encode());
        },
        StatusCode::kIncompatibleLayout);
    EXPECT_TRUE(untouched(*cache));
  }
  {
    auto f = good;
    f.layout.page_order = PageOrder::kHND;
    expect_rejected(f, StatusCode::kIncompatibleLayout, "wrong layout (order)");
  }
  {
    auto f = good;
    f.size = 1ull << 40;  // bigger than registered
    expect_rejected(f, StatusCode::kPermissionDenied, "region size");
  }
  {
    auto f = good;
    f.session_id = "127.0.0.1:1";  // nobody listens there
    try {
      m->start_async_retrieve(0, 64, iota_pages(4), seq.page_indices, f.encode());
      ADD_FAILURE() << "unreachable peer accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == StatusCode::kPeerFailure || e.code() == StatusCode::kTimeout)
          << e.what();
    }
    EXPECT_TRUE(untouched(*cache));
  }
  // The genuine descriptor still works on the same engine.
  m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, iota_pages(4), 0, 64).ok());
}

// A layout change (NHD <- HND) and a head split make rows of 128 bytes: the
// owner gathers many of them into one message (kReqGather: eager for small
// groups, rendezvous with an iov on both sides for big ones; eager only
// for am_shm readers) and the reader scatters them. Every byte lands where
// the per-row plan says, nothing else is touched.
TEST_P(UcxEngine, LayoutChangesGatherManySmallRows) {
  const KVLayout owner = small_layout(256, CacheOrder::kPageMajor, PageOrder::kHND);
  PeerProcess peer(spec(owner, 256 * 16));
  const auto& seq = peer.sequence();
  for (int split = 0; split < 2; ++split) {
    KVLayout l = small_layout(256, CacheOrder::kLayerMajor, PageOrder::kNHD);
    if (split) {  // TP 1 -> 2, rank 1: head 1 of 2
      l.total_kv_heads = 2;
      l.first_kv_head = 1;
      l.num_kv_heads = 1;
    }
    auto cache = local_cache(l);
    auto m = manager(cache, 20000ms);
    std::vector<std::uint32_t> lp = iota_pages(seq.page_indices.size());
    std::reverse(lp.begin(), lp.end());
    auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->get(), l.total_bytes());
    // Planned as strided spans (kReqStrided on the wire): NHD <- HND one per
    // (page, layer, k|v, head), not one per (token, head) row. (The head
    // split is one contiguous run per page either way: one head, HND.)
    const auto reads = plan_reads(l, owner, 0, seq.num_tokens, lp, seq.page_indices);
    EXPECT_EQ(f->timing().copies, plan_strided_copies(l, owner, reads).spans.size());
    if (!split) {
      EXPECT_LE(f->timing().copies * 16, plan_copies(l, owner, reads).spans.size());
    }
    const auto v = verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens);
    EXPECT_TRUE(v.ok()) << (split ? "head split: " : "nhd <- hnd: ") << v.first_mismatch;
  }
  // A prefix hit mid-page: only the tail's rows, the rest keeps the sentinel.
  const KVLayout l = small_layout(256, CacheOrder::kLayerMajor, PageOrder::kNHD);
  auto cache = local_cache(l);
  auto m = manager(cache, 20000ms);
  const std::vector<std::uint32_t> lp = iota_pages(seq.page_indices.size());
  m->sync_retrieve(1000, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 1000, seq.num_tokens).ok());
  const KVLayout probe = small_layout(256);
  std::size_t touched = 0;
  for (std::uint32_t layer = 0; layer < probe.num_layers; ++layer) {
    for (std::uint32_t kv = 0; kv < 2; ++kv) {
      for (std::uint64_t t = 0; t < 1000; ++t) {  // the cached prefix's rows
        const auto off = l.block_offset(layer, static_cast<KV>(kv), lp[t / 16]) +
                         l.in_block_offset(static_cast<std::uint32_t>(t % 16), 0);
        for (std::uint64_t b = 0; b < l.token_bytes(); ++b) {
          touched += cache->base()[off + b] != kSentinel;
        }
      }
    }
  }
  EXPECT_EQ(touched, 0u) << "bytes of the cached prefix were written";
}

// extra["auth_token"] (ucx_auth.hpp): the owner and the reader prove the
// shared secret to each other before the owner describes its region; a
// reader without it, with another one, or an owner without one is refused
// before any byte moves, and the right token pulls every byte.
TEST_P(UcxEngine, AuthTokenIsProvedBothWaysBeforeAnyByteMoves) {
  const KVLayout l = small_layout(64);
  const std::string token = "0123456789abcdef-secret";
  PeerSpec s = spec(l, 64);
  s.extra["auth_token"] = token;
  PeerProcess peer(s);
  const auto& seq = peer.sequence();
  auto refused = [&](const std::string& reader_token, const std::string& want,
                     const KVTransferInfo& info, const std::vector<std::uint32_t>& rp) {
    auto cache = local_cache(l);
    std::map<std::string, std::string> more;
    if (!reader_token.empty()) more["auth_token"] = reader_token;
    auto m = manager(cache, 5000ms, more);
    try {
      auto f = m->start_async_retrieve(0, 64, iota_pages(4), rp, info);
      if (f) f->wait_for(5s);
      ADD_FAILURE() << "reader token '" << reader_token << "': accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kPermissionDenied) << e.what();
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find(token), std::string::npos)
          << "an error must not show the secret: " << e.what();
    }
    EXPECT_TRUE(untouched(*cache)) << "reader token '" << reader_token << "': bytes moved";
  };
  refused("", "requires an auth_token", seq.kv_transfer_info, seq.page_indices);
  refused("another-token-of-16-bytes", "proof of the auth_token is wrong", seq.kv_transfer_info,
          seq.page_indices);
  {
    // The right token pulls every byte.
    auto cache = local_cache(l);
    auto m = manager(cache, 5000ms, {{"auth_token", token}});
    EXPECT_EQ(m->sync_retrieve(0, 64, iota_pages(4), seq.page_indices, seq.kv_transfer_info),
              4 * l.page_bytes_all_layers());
    EXPECT_TRUE(verify_pattern(*cache, kSeed, iota_pages(4), 0, 64).ok());
  }
  // A reader with a token never takes KV from an owner that cannot prove it.
  PeerProcess open_peer(spec(l, 64));
  refused(token, "the owner did not prove it", open_peer.sequence().kv_transfer_info,
          open_peer.sequence().page_indices);
  // A token too short to be a secret is refused when the engine is made.
  EngineOptions o;
  o.extra = {{"auth_token", "short"}};
  EXPECT_THROW(KVTransferManager(TransferEngineInfo{"decode", "", "ucx", o}, local_cache(l)),
               Error);
}

TEST_P(UcxEngine, KilledPeerFailsInTimeOthersKeepWorkingAndANewPeerServes) {
  if (!GetParam().no_kill.empty()) GTEST_SKIP() << GetParam().no_kill;
  const KVLayout big = small_layout(4096);  // 128 MiB
  PeerProcess doomed(spec(big, 4096 * 16));
  PeerProcess other(spec(small_layout(64), 64));
  auto cache = local_cache(big);
  auto m = manager(cache, 3000ms);
  const auto& seq = doomed.sequence();
  const auto lp = iota_pages(seq.page_indices.size());
  const auto t0 = std::chrono::steady_clock::now();
  // Several pulls in flight so that the kill lands in the middle of one.
  std::vector<TransferFuture> fs;
  for (int i = 0; i < 4; ++i) {
    fs.push_back(
        *m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info));
  }
  std::this_thread::sleep_for(5ms);
  doomed.kill_now();
  const bool any_failed = any_failed_after_peer_death(fs);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3000ms + 2s);
  if (!any_failed) {
    // Finished before the kill: then the bytes must be right.
    EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens).ok());
  }
  // Another peer keeps working on the same engine.
  auto small = local_cache(small_layout(64));
  auto m2 = manager(small);
  m2->sync_retrieve(0, 64, iota_pages(4), other.sequence().page_indices,
                    other.sequence().kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*small, kSeed, iota_pages(4), 0, 64).ok());
  m->sync_retrieve(0, 64, {lp.data(), 4}, other.sequence().page_indices,
                   other.sequence().kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, {lp.data(), 4}, 0, 64).ok());
  // A new peer (new listener) serves the same engine.
  PeerProcess again(spec(small_layout(64), 64));
  std::memset(cache->base(), static_cast<int>(kSentinel), cache->size_bytes());
  m->sync_retrieve(0, 64, {lp.data(), 4}, again.sequence().page_indices,
                   again.sequence().kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, {lp.data(), 4}, 0, 64).ok());
}

TEST_P(UcxEngine, NewOwnerAtTheSameAddressIsReachedAfresh) {
  // Both owners live in this process (separate UCX contexts, real loopback
  // traffic); the second listens where the first did.
  const KVLayout l = small_layout(64);
  auto reader_cache = local_cache(l);
  auto reader = manager(reader_cache);
  EngineOptions o;
  o.extra = extra();
  auto owner_cache = make_kv_cache(l, MemoryKind::kHost);
  std::unique_ptr<KVTransferManager> owner;
  std::string session;
  for (int attempt = 0; attempt < 20 && !owner; ++attempt) {
    session = "127.0.0.1:" + std::to_string(20000 + (::getpid() * 7 + attempt * 131) % 9000);
    try {
      owner = std::make_unique<KVTransferManager>(TransferEngineInfo{"owner", session, "ucx", o},
                                                  owner_cache);
    } catch (const Error&) {
    }
  }
  ASSERT_TRUE(owner) << "no free port";
  const std::vector<std::uint32_t> pages{5, 9, 2, 40};
  fill_pattern(*owner_cache, kSeed, pages, 0, 64);
  const KVTransferInfo first = owner->get_kv_transfer_info();
  reader->sync_retrieve(0, 64, iota_pages(4), pages, first);
  EXPECT_TRUE(verify_pattern(*reader_cache, kSeed, iota_pages(4), 0, 64).ok());

  owner.reset();  // the owner goes away; its listener port is free again
  auto owner2_cache = make_kv_cache(l, MemoryKind::kHost);
  fill_pattern(*owner2_cache, kSeed + 1, pages, 0, 64);
  std::unique_ptr<KVTransferManager> owner2;
  for (int attempt = 0; attempt < 50 && !owner2; ++attempt) {
    try {
      owner2 = std::make_unique<KVTransferManager>(TransferEngineInfo{"owner", session, "ucx", o},
                                                   owner2_cache);
    } catch (const Error&) {
      std::this_thread::sleep_for(100ms);
    }
  }
  ASSERT_TRUE(owner2) << "could not listen on " << session << " again";
  std::memset(reader_cache->base(), static_cast<int>(kSentinel), reader_cache->size_bytes());
  // The first owner's descriptor names a generation nobody serves any more.
  try {
    auto f = reader->start_async_retrieve(0, 64, iota_pages(4), pages, first);
    ASSERT_TRUE(f && f->wait_for(10s));
    EXPECT_FALSE(f->status().is_ok()) << "a dead owner's descriptor was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kStaleDescriptor) << e.what();
  }
  EXPECT_TRUE(untouched(*reader_cache));
  reader->sync_retrieve(0, 64, iota_pages(4), pages, owner2->get_kv_transfer_info());
  EXPECT_TRUE(verify_pattern(*reader_cache, kSeed + 1, iota_pages(4), 0, 64).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxEngine, ucx_cases(), case_name);

// Found by an adopter: a misspelled UCX option was silently ignored.
TEST(UcxOptions, UnknownUcxKeyIsRejectedListingTheKnownOnes) {
  const KVLayout l = testing::make_layout(1, 4, 16, 1, 8);
  auto c = make_kv_cache(l, MemoryKind::kHost);
  TransferEngineInfo info{"me", "127.0.0.1:0", "ucx", {}};
  info.options.extra = {{"ucx_mdoe", "am"}};
  testing::expect_error([&] { KVTransferManager m(info, c); }, StatusCode::kInvalidArgument,
                        {"unknown UCX option 'ucx_mdoe' (known: ucx_mode"});
  info.options.extra = {{"ucx_progress", "spin"}};
  testing::expect_error([&] { KVTransferManager m(info, c); }, StatusCode::kInvalidArgument,
                        {"ucx_progress 'spin' is not one of adaptive, busy, event"});
  info.options.extra = {{"ucx_emulated_gets", "yes"}};
  testing::expect_error([&] { KVTransferManager m(info, c); }, StatusCode::kInvalidArgument,
                        {"ucx_emulated_gets 'yes' is not one of on, off"});
}

}  // namespace
}  // namespace mstar::kv::ucx_test
