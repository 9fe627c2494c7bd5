// Copyright mstar-kv authors.
//
// Pulls as the vLLM connector makes them (python/mstar_kv/integrations/vllm/
// consumer.py): many small reads issued from one thread and only ever
// polled for completion (ready(), never a wait: nothing drives the reader
// but its own progress thread), from several owner processes at once,
// while first reads to new owners connect on another thread and fresh
// readers connect to every owner. Every read resolves by itself, long
// before the engine's timeout, with the owner's bytes.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "mstar/kv/testing/pattern.hpp"
#include "ucx_fixture.hpp"

namespace mstar::kv::ucx_test {
namespace {

using testing::make_layout;

constexpr std::uint32_t kOwnerPages = 64;
constexpr std::uint32_t kMaxPages = 6;  // pages a read moves, in one or two runs
constexpr std::uint32_t kSlots = 24;    // reads in flight land in their own pages
constexpr std::uint32_t kGap = 17;      // a second run starts this many pages on

// 2 layers, 16 KiB blocks: a run of 1-6 pages is a span of 16-96 KiB per
// layer and K/V, below and above the rendezvous threshold (32 KiB).
KVLayout polled_layout(std::uint32_t pages) { return make_layout(2, pages, 16, 2, 256); }

// One read in flight: where it lands, from which of the owner's pages.
struct Pull {
  TransferFuture future;
  const KVCache* cache = nullptr;  // where it lands
  std::uint64_t seed = kSeed;      // the owner's pattern
  bool stale = false;              // of a sequence the owner released: refused, nothing lands
  std::vector<std::pair<std::uint32_t, std::uint32_t>> pages;  // owner page -> local page
  std::string what;
};

class UcxPolledPull : public UcxFixture {
 protected:
  void SetUp() override {
    UcxFixture::SetUp();
    if (IsSkipped() || !GetParam().tls.empty()) return;
    // vLLM's setting: UCX picks among every transport and device it finds.
    ::unsetenv("UCX_TLS");
    ::unsetenv("UCX_NET_DEVICES");
  }
  // An owner of `l`'s pages in order; every other one a cache of one region
  // per layer (vLLM's per-layer tensors).
  PeerSpec owner_spec(const KVLayout& l) {
    PeerSpec s = spec(l, std::uint64_t{l.num_pages} * l.page_size, 0);
    s.setup.layer_regions = owners_made_++ % 2 == 0;
    if (GetParam().tls.empty()) {
      s.env.erase("UCX_TLS");
      s.env.erase("UCX_NET_DEVICES");
    }
    return s;
  }

  // Rounds: MSTAR_KV_UCX_POLLED_ROUNDS (a longer soak by hand), else 60.
  static int rounds() {
    const char* env = std::getenv("MSTAR_KV_UCX_POLLED_ROUNDS");
    return env != nullptr ? std::max(1, std::atoi(env)) : 60;
  }

  // What one read moves: 1-6 of the owner's pages from `first`, in one run
  // or in two runs kGap apart, into local slot `slot`.
  struct Draw {
    std::uint32_t n = 1, first = 0, slot = 0;
    bool two_runs = false;
  };
  Draw draw(std::uint32_t slot) {
    Draw d;
    d.n = 1 + static_cast<std::uint32_t>(rng_() % kMaxPages);
    d.two_runs = d.n >= 2 && rng_() % 2 == 0;
    d.first = static_cast<std::uint32_t>(rng_() % (kOwnerPages - kGap - d.n));
    d.slot = slot % kSlots;
    return d;
  }

  // Issues the read `d` (its slot's pages first reset to the sentinel).
  // Any thread; reads in flight at once have slots of their own.
  static Pull issue(KVTransferManager& m, KVCache& cache, const SequenceInfo& seq, const Draw& d,
                    const std::string& owner) {
    const KVLayout& l = cache.layout();
    const auto [n, first, slot, two_runs] = d;
    Pull p;
    p.cache = &cache;
    std::vector<std::uint32_t> remote, local;
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint32_t owner_page = first + i + (two_runs && i >= n / 2 ? kGap : 0);
      const std::uint32_t local_page = slot * kMaxPages + i;
      p.pages.emplace_back(owner_page, local_page);
      remote.push_back(seq.page_indices[owner_page]);
      local.push_back(local_page);
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        for (KV kv : {KV::kKey, KV::kValue}) {
          std::memset(cache.at(l.block_offset(layer, kv, local_page)), static_cast<int>(kSentinel),
                      l.block_bytes());
        }
      }
    }
    p.what = owner + ": " + std::to_string(n) + " pages from " + std::to_string(first) +
             (two_runs ? " in two runs" : "");
    // Tokens [0, 16n) of a table whose pages are the ones picked: the
    // owner's pages need not be its first ones.
    auto f = m.start_async_retrieve(0, std::uint64_t{n} * l.page_size, local, remote,
                                    seq.kv_transfer_info);
    EXPECT_TRUE(f.has_value()) << p.what;
    if (f) p.future = std::move(*f);
    return p;
  }

  // Each page read holds the owner's pattern for that page's tokens.
  static void expect_bytes(const Pull& p) {
    const KVCache& cache = *p.cache;
    for (const auto& [owner_page, local_page] : p.pages) {
      std::vector<std::uint32_t> table(owner_page + 1, 0);
      table[owner_page] = local_page;
      const std::uint64_t t0 = std::uint64_t{owner_page} * cache.layout().page_size;
      const auto v = verify_pattern(cache, p.seed, table, t0, t0 + cache.layout().page_size);
      EXPECT_TRUE(v.ok()) << p.what << ", owner page " << owner_page << ": " << v.first_mismatch;
    }
  }

  std::mt19937 rng_{12345};
  int owners_made_ = 0;
};

TEST_P(UcxPolledPull, ManySmallPolledReadsFromSeveralOwnersEachResolveByThemselves) {
  const KVLayout owner_layout = polled_layout(kOwnerPages);
  // An owner process and the pattern of its current sequence.
  struct Owner {
    std::unique_ptr<PeerProcess> peer;
    std::uint64_t seed = kSeed;
  };
  std::vector<Owner> owners;
  for (int i = 0; i < 2; ++i) {
    owners.push_back({std::make_unique<PeerProcess>(owner_spec(owner_layout)), kSeed});
  }
  // Two readers (two vLLM decode engines pull from one prefill), each with
  // a cache of one region per layer, as vLLM's.
  struct Reader {
    std::shared_ptr<KVCache> cache;
    std::unique_ptr<KVTransferManager> m;
  };
  // Far beyond what any of these reads takes: a read that meets it waited
  // for an event that never came.
  const auto engine_timeout = 20000ms;
  const auto poll_limit = std::chrono::milliseconds(15000);
  std::vector<Reader> readers(2);
  for (Reader& r : readers) {
    r.cache = KVCache::create_host_layers(polled_layout(kSlots * kMaxPages));
    r.m = manager(r.cache, engine_timeout);
  }
  std::uint32_t slot = 0;
  int reads = 0;
  const int n = rounds();
  for (int round = 0; round < n; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // Now and then an idle spell, as between a vLLM engine's pulls: both
    // sides' progress threads go to sleep on their event fds.
    if (rng_() % 4 == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(120 + rng_() % 280));
    }
    // A fresh reader now and then: first reads to every owner at once.
    if (round % 20 == 19) {
      Reader& r = readers[round / 20 % readers.size()];
      r.m = manager(r.cache, engine_timeout);
    }
    // A new owner now and then: its first read (the connect) runs on
    // another thread while this one issues reads to the known owners. That
    // read names a sequence the owner has released since (a vLLM decode
    // pulling from params whose pages were freed): refused as stale; the
    // next read on the same connection follows at once.
    std::unique_ptr<PeerProcess> fresh;
    std::optional<SequenceInfo> released;
    std::size_t fresh_reader = 0;
    if (round % 15 == 7) {
      fresh = std::make_unique<PeerProcess>(owner_spec(owner_layout));
      released = fresh->sequence();
      fresh->command("next 0");  // sequence 2 on the same pages, pattern kSeed + 2
    }
    std::vector<Pull> pulls;
    std::optional<Pull> first;
    std::thread connecting;
    if (fresh) {
      // Drawn here; the connect inside the issue blocks that thread only.
      const Draw d = draw(slot++);
      fresh_reader = rng_() % readers.size();
      Reader& r = readers[fresh_reader];
      connecting = std::thread([&, d] {
        first = issue(*r.m, *r.cache, *released, d, "new owner " + std::to_string(round));
        first->stale = true;
      });
      // Give the connect a head start, so that it races the reads below.
      std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 2000));
    }
    const int batch = 2 + static_cast<int>(rng_() % 6);
    for (int i = 0; i < batch; ++i) {
      const std::size_t o = rng_() % owners.size();
      const std::size_t ri = rng_() % readers.size();
      pulls.push_back(issue(*readers[ri].m, *readers[ri].cache, owners[o].peer->sequence(),
                            draw(slot++),
                            "reader " + std::to_string(ri) + ", owner " + std::to_string(o)));
      pulls.back().seed = owners[o].seed;
    }
    if (connecting.joinable()) connecting.join();
    if (first) {
      // Half the time the next read waits until the refusal arrived and
      // both sides idled (the connector retries through the side channel
      // first).
      if (rng_() % 2 == 0) {
        const auto until = std::chrono::steady_clock::now() + poll_limit;
        while (!first->future.ready() && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng_() % 1000));
      }
      pulls.push_back(std::move(*first));
      Reader& r = readers[fresh_reader];
      pulls.push_back(issue(*r.m, *r.cache, fresh->sequence(), draw(slot++),
                            "new owner " + std::to_string(round) + ", after the refusal"));
      pulls.back().seed = kSeed + 2;
    }
    // Reaped as the connector does: ready(), never a wait.
    const auto deadline = std::chrono::steady_clock::now() + poll_limit;
    for (;;) {
      const bool all =
          std::all_of(pulls.begin(), pulls.end(), [](const Pull& p) { return p.future.ready(); });
      if (all || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    for (const Pull& p : pulls) {
      ASSERT_TRUE(p.future.ready())
          << p.what << ": unresolved after " << poll_limit.count() << " ms of polling";
      if (p.stale) {
        EXPECT_EQ(p.future.status().code(), StatusCode::kStaleDescriptor)
            << p.what << ": " << p.future.status().to_string();
        continue;
      }
      ASSERT_TRUE(p.future.status().is_ok()) << p.what << ": " << p.future.status().to_string();
      expect_bytes(p);
      ++reads;
    }
    if (fresh) {
      owners.push_back({std::move(fresh), kSeed + 2});
      if (owners.size() > 4) owners.erase(owners.begin());  // gone with its connections
    }
  }
  EXPECT_GE(reads, 2 * n);
}

// Every case of the engine's tests, and "default": no UCX_TLS and no
// UCX_NET_DEVICES, as vLLM runs it (every transport, tcp on every device).
std::vector<UcxCase> polled_cases() {
  std::vector<UcxCase> out{UcxCase{"default", "", "auto", ""}};
  const ::testing::internal::ParamGenerator<UcxCase> all = ucx_cases();
  for (const UcxCase& c : all) out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxPolledPull, ::testing::ValuesIn(polled_cases()), case_name);

}  // namespace
}  // namespace mstar::kv::ucx_test
