// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s decode threads: each pulls random published sequences
// into its own pages through the engines under test and checks every byte
// (the rules are in cmd_soak.cpp's header comment).
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "soak_shared.hpp"

namespace mstar::kv::cli::soak {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

}  // namespace

Ranges merged(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [b, e] : r) {
    if (!out.empty() && b <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}

// Blocks of `pages` (every layer, k and v): the bytes a thread owns.
Ranges page_ranges(const KVLayout& l, const std::vector<std::uint32_t>& pages) {
  Ranges r;
  for (std::uint32_t p : pages) {
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
        const std::uint64_t off = l.block_offset(layer, static_cast<KV>(kv), p);
        r.emplace_back(off, off + l.block_bytes());
      }
    }
  }
  return merged(std::move(r));
}

// Copies of the bytes of `ranges`.
std::vector<std::byte> save(const KVCache& c, const Ranges& ranges) {
  std::vector<std::byte> out;
  for (const auto& [b, e] : ranges) out.insert(out.end(), c.base() + b, c.base() + e);
  return out;
}

// First offset inside `ranges` but outside `allowed` where the cache differs
// from `saved` (the bytes of `ranges`); -1 when none.
std::int64_t changed(const KVCache& c, const Ranges& ranges, const std::vector<std::byte>& saved,
                     const Ranges& allowed) {
  std::size_t pos = 0;
  std::size_t a = 0;
  for (const auto& [b, e] : ranges) {
    std::uint64_t x = b;
    while (x < e) {
      while (a < allowed.size() && allowed[a].second <= x) ++a;
      std::uint64_t stop = e;
      if (a < allowed.size() && allowed[a].first <= x) {
        x = std::min(e, allowed[a].second);  // skip the allowed part
        continue;
      }
      if (a < allowed.size()) stop = std::min(stop, allowed[a].first);
      const std::byte* now = c.base() + x;
      const std::byte* was = saved.data() + pos + (x - b);
      if (std::memcmp(now, was, stop - x) != 0) {
        for (std::uint64_t i = 0; i < stop - x; ++i) {
          if (now[i] != was[i]) return static_cast<std::int64_t>(x + i);
        }
      }
      x = stop;
    }
    pos += e - b;
  }
  return -1;
}

void fill_sentinel(const KVCache& c, const Ranges& ranges, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  for (const auto& [b, e] : ranges) {
    std::uint64_t i = b;
    for (; i + 8 <= e; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(c.base() + i, &x, 8);
    }
    for (; i < e; ++i) c.base()[i] = std::byte{0xA5};
  }
}

void decode_thread(std::size_t t, const DecodeConfig& cfg, const KVCache& cache,
                   const KVLayout& remote_layout, std::vector<std::uint32_t> region,
                   std::map<std::string, KVTransferEngine*> engines, Shared& shared, Stats& stats,
                   const std::atomic<bool>& stop) {
  const KVLayout& l = cache.layout();
  std::mt19937_64 rng(cfg.seed * 1000003 + t);
  const Ranges mine = page_ranges(l, region);
  std::uint64_t n = 0;
  while (!stop.load(std::memory_order_relaxed)) {
    const std::size_t slot = rng() % shared.size();
    auto pub = shared.get(slot);
    if (!pub || pub->seqs.empty()) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    const SequenceInfo& seq = pub->seqs[rng() % pub->seqs.size()];
    KVTransferEngine* engine = engines.at(pub->engine);
    std::shuffle(region.begin(), region.end(), rng);
    std::vector<std::uint32_t> lp(region.begin(),
                                  region.begin() + static_cast<std::ptrdiff_t>(seq.page_indices.size()));
    const std::uint64_t start = rng() % 4 == 0 ? rng() % seq.num_tokens : 0;
    const auto reads = plan_reads(l, start, seq.num_tokens, lp, seq.page_indices);
    Ranges allowed;
    for (const CopySpan& s : plan_copies(l, remote_layout, reads).spans) {
      allowed.emplace_back(s.local_offset, s.local_offset + s.length);
    }
    allowed = merged(std::move(allowed));
    fill_sentinel(cache, mine, cfg.seed ^ (t << 40) ^ ++n);
    const std::vector<std::byte> before = save(cache, mine);
    stats.requests.fetch_add(1, std::memory_order_relaxed);
    const std::string what = "thread " + std::to_string(t) + " request " + std::to_string(n) +
                             " (" + pub->engine + ", seq " + std::to_string(seq.seq_id) + ")";

    std::optional<TransferFuture> f;
    try {
      f = engine->read_batched_async(seq.kv_transfer_info, reads);
    } catch (const Error& e) {
      stats.rejected.fetch_add(1, std::memory_order_relaxed);
      stats.failure(e.code());
      if (changed(cache, mine, before, {}) >= 0) stats.corruption(what + ": rejected read wrote");
      continue;
    }
    if (!f || !f->wait_for(cfg.timeout + 5s)) {
      // Its pages may still be written: this thread stops using them.
      stats.hangs.fetch_add(1, std::memory_order_relaxed);
      stats.corruption(what + ": the future did not resolve within the timeout + 5 s");
      return;
    }
    const Status st = f->status();
    if (st.is_ok()) {
      const VerifyResult v = verify_pattern(cache, pattern_seed(seq.seq_id), lp, start, seq.num_tokens);
      if (v.ok()) {
        stats.ok.fetch_add(1, std::memory_order_relaxed);
        stats.bytes_verified.fetch_add(v.bytes_checked, std::memory_order_relaxed);
      } else {
        // Another request's KV (or garbage) reported as this one's: the bug
        // page epochs exist to prevent.
        stats.wrong_sequence.fetch_add(1, std::memory_order_relaxed);
        stats.corruption(what + ": success reported but " + v.first_mismatch);
      }
    } else {
      stats.failed.fetch_add(1, std::memory_order_relaxed);
      stats.failure(st.code());
      const std::vector<std::byte> at_resolution = save(cache, mine);
      std::this_thread::sleep_for(cfg.grace);
      const std::int64_t late = changed(cache, mine, at_resolution, {});
      if (late >= 0) {
        stats.corruption(what + ": byte " + std::to_string(late) + " changed after the future resolved with " +
                         st.to_string());
      }
    }
    const std::int64_t outside = changed(cache, mine, before, allowed);
    if (outside >= 0) {
      stats.corruption(what + ": byte " + std::to_string(outside) +
                       " outside the read's destination spans changed");
    }
  }
}

}  // namespace mstar::kv::cli::soak
