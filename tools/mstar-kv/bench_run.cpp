// Copyright mstar-kv authors.
#include "bench_run.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "bench_proc.hpp"
#include "bench_server.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "toolkit/span_copy.hpp"

namespace mstar::kv::cli::bench {

namespace {

using Clock = std::chrono::steady_clock;

// ---- memcpy on a fixed number of threads: the kit's span-copy pool ----------

using toolkit::partition;
using toolkit::Partition;
using CopyPool = toolkit::SpanCopyPool;

// Sets environment variables for the client side of a variant (UCX reads
// UCX_TLS when its context is created) and restores them afterwards. Only
// the main thread touches the environment, between engine lifetimes.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& env) {
    for (const auto& [k, v] : env) {
      const char* old = std::getenv(k.c_str());
      saved_.emplace_back(k, old != nullptr ? std::optional<std::string>(old) : std::nullopt);
      ::setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// ---- measuring ----------------------------------------------------------------

struct Side {
  std::vector<double> gbps;
  std::vector<double> rps;
  std::vector<double> latency_ns;
  std::uint64_t requests = 0;
};

// Per-phase durations of the engine's requests (ns), from the futures' stamps.
struct Phases {
  std::vector<double> prep, post, transfer;
  std::uint64_t copies = 0;  // what the engine planned (strided spans count once)

  void add(Clock::time_point called, Clock::time_point returned, const TransferTiming& t) {
    const std::array<double, 3> s = phase_seconds(t, called, returned);
    prep.push_back(s[0] * 1e9);
    post.push_back(s[1] * 1e9);
    transfer.push_back(s[2] * 1e9);
    copies = t.copies;
  }
};

template <typename Request>
void repetition(const RunOptions& o, std::uint64_t bytes, Side& side, Request&& request) {
  const auto t0 = Clock::now();
  std::uint64_t n = 0;
  double elapsed = 0;
  do {
    const auto a = Clock::now();
    request();
    const auto b = Clock::now();
    side.latency_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
    ++n;
    elapsed = std::chrono::duration<double>(b - t0).count();
  } while (n < o.min_requests || elapsed < o.min_time_s);
  side.gbps.push_back(static_cast<double>(bytes) * static_cast<double>(n) / elapsed / 1e9);
  side.rps.push_back(static_cast<double>(n) / elapsed);
  side.requests += n;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const auto k = static_cast<std::size_t>(std::lround(q * static_cast<double>(v.size() - 1)));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

std::uint64_t median_span(const CopyPlan& plan) {
  if (plan.spans.empty()) return 0;
  std::vector<std::uint64_t> len;
  len.reserve(plan.spans.size());
  for (const CopySpan& s : plan.spans) len.push_back(s.length);
  std::nth_element(len.begin(), len.begin() + static_cast<std::ptrdiff_t>(len.size() / 2),
                   len.end());
  return len[len.size() / 2];
}

std::shared_ptr<KVCache> make_local_cache(const EngineVariant& v, const KVLayout& l) {
  if (v.layer_regions && v.local_kind == MemoryKind::kHost && l.layer_contiguous()) {
    return KVCache::create_host_layers(l);
  }
  return make_kv_cache(l, v.local_kind);
}

void wait_ok(const std::optional<TransferFuture>& f, std::chrono::milliseconds timeout,
             std::uint64_t expect_bytes) {
  if (!f) throw Error(StatusCode::kInternal, "engine returned no future for a non-empty read");
  if (!f->wait_for(timeout + std::chrono::milliseconds(5000))) {
    f->cancel();
    throw Error(StatusCode::kTimeout, "read did not resolve within the engine timeout + 5 s");
  }
  const Status st = f->status();
  if (!st.is_ok()) throw Error(st);
  if (f->bytes() != expect_bytes) {
    throw Error(StatusCode::kInternal, "engine reported " + std::to_string(f->bytes()) +
                                           " bytes read, the request holds " +
                                           std::to_string(expect_bytes));
  }
}

void run_case_inner(const EngineVariant& v, const Workload& w, const RunOptions& o, CaseResult& r) {
  const std::uint64_t bytes = w.bytes_per_request();
  const std::vector<std::uint32_t> lp = local_page_table(w);
  const std::vector<std::uint32_t> rp_planned = remote_page_table(w);
  auto progress = [&](const std::string& what) {
    if (o.progress) o.progress(what);
  };

  CopyPool pool(o.threads);
  Side engine_side;
  Side base_side;
  std::shared_ptr<KVCache> local;
  std::shared_ptr<KVCache> src;  // in-process copy of the remote cache: baseline source

  // Both sides are declared before the engine so that the engine goes first.
  std::unique_ptr<Server> server;
  std::unique_ptr<KVTransferManager> manager;
  std::unique_ptr<KVTransferManager> manager_off;  // epoch checks off (epoch_ab)
  std::function<void()> request;
  std::function<void()> request_off;
  Side off_side;
  Phases phases;  // filled by the manager path's requests
  std::vector<std::uint32_t> rp = rp_planned;
  KVTransferInfo remote_info;

  if (!v.remote_in_child) {
    // The in-process planner + memcpy path: what an engine costs at best.
    local = make_local_cache(v, w.local);
    src = KVCache::create_host(w.remote);
    fill_pattern(*src, kFillSeed, rp, 0, w.tokens);
    request = [&] {
      const auto reads = plan_reads(w.local, w.remote, w.start_len, w.tokens, lp, rp);
      const CopyPlan plan = plan_copies(w.local, w.remote, reads);
      pool.run(partition(plan.spans, pool.size()), local->regions(), src->regions());
    };
  } else {
    progress("starting server");
    server = std::make_unique<Server>(v, w, o);
    const SequenceInfo seq = server->publish(1, w.tokens, rp_planned);
    rp = seq.page_indices;
    remote_info = seq.kv_transfer_info;
    ScopedEnv env(v.env);
    local = make_local_cache(v, w.local);
    EngineOptions eo;
    eo.max_workers = o.threads;
    eo.timeout = o.timeout;
    eo.extra = o.engine_extra;
    eo.extra.insert(v.extra.begin(), v.extra.end());
    // An empty session id lets each engine pick its own address (UCX: a free
    // port on 127.0.0.1; Mooncake: 127.0.0.1 with the P2P handshake).
    const std::string me = "bench-client-" + std::to_string(::getpid());
    try {
      manager =
          std::make_unique<KVTransferManager>(TransferEngineInfo{me, "", v.engine, eo}, local);
    } catch (const Error& e) {
      // Some engines want their own cache in shared memory too.
      if (e.code() != StatusCode::kInvalidArgument || v.local_kind != MemoryKind::kHost) throw;
      local = make_kv_cache(w.local, MemoryKind::kSharedHost);
      manager =
          std::make_unique<KVTransferManager>(TransferEngineInfo{me, "", v.engine, eo}, local);
    }
    request = [&] {
      const auto called = Clock::now();
      auto f = manager->start_async_retrieve(w.start_len, w.tokens, lp, rp, remote_info);
      const auto returned = Clock::now();
      wait_ok(f, o.timeout, bytes);
      phases.add(called, returned, f->timing());
    };
    if (o.epoch_ab) {
      EngineOptions off = eo;
      off.check_epochs = o.epoch_ab_control;  // control: both sides check
      manager_off = std::make_unique<KVTransferManager>(
          TransferEngineInfo{me + "-noepoch", "", v.engine, off}, local);
      request_off = [&] {
        auto f = manager_off->start_async_retrieve(w.start_len, w.tokens, lp, rp, remote_info);
        wait_ok(f, o.timeout, bytes);
      };
    }
    if (v.memcpy_baseline && host_accessible(local->memory_kind())) {
      src = KVCache::create_host(w.remote);
    }
  }

  const auto reads = plan_reads(w.local, w.remote, w.start_len, w.tokens, lp, rp);
  const CopyPlan plan = plan_copies(w.local, w.remote, reads);
  r.reads = reads.size();
  r.copies = plan.spans.size();
  r.uncoalesced = plan.uncoalesced_spans;
  r.piece_bytes = median_span(plan);
  // The baseline copies the plan's spans, or, between caches of different
  // geometry (page size, heads, in-page order), the same number of bytes laid
  // out contiguously: what the conversion costs against moving the bytes.
  // (A local cache of one region per layer takes them layer by layer.)
  std::vector<CopySpan> contiguous;
  for (std::uint64_t at = 0; at < bytes;) {
    const std::uint64_t n = local->regions().run_bytes(at, bytes - at);
    contiguous.push_back({at, at, n});
    at += n;
  }
  const std::span<const CopySpan> base_spans = w.mixed_geometry()
                                                   ? std::span<const CopySpan>(contiguous)
                                                   : std::span<const CopySpan>(plan.spans);
  if (src && v.remote_in_child) {
    // Touch the source so that the baseline does not read the zero page.
    for (const CopySpan& s : plan.spans) std::memset(src->base() + s.remote_offset, 0x5a, s.length);
    if (w.mixed_geometry()) std::memset(src->base(), 0x5a, bytes);
  }

  // Warm-up request, then check that every byte arrived.
  progress("warm-up");
  request();
  if (o.verify && host_accessible(local->memory_kind())) {
    const VerifyResult vr = verify_pattern(*local, kFillSeed, lp, w.start_len, w.tokens);
    if (!vr.ok()) {
      throw Error(StatusCode::kInternal,
                  "verification failed: " + std::to_string(vr.mismatched_blocks) + " of " +
                      std::to_string(vr.blocks_checked) +
                      " blocks differ, first: " + vr.first_mismatch);
    }
    r.verified = true;
  }
  const bool baseline = src != nullptr && v.memcpy_baseline;
  // The baseline is the fastest this machine copies the same spans, whatever
  // --threads the engine runs with; chosen once here, outside the timing.
  std::optional<toolkit::BestCopy> best;
  if (baseline) {
    progress("baseline");
    best.emplace(base_spans, toolkit::hardware_threads());
    best->calibrate(local->regions(), src->regions());
  }

  for (std::uint32_t i = 0; i < o.repeat; ++i) {
    progress("rep " + std::to_string(i + 1) + "/" + std::to_string(o.repeat));
    // With epoch_ab, on and off alternate and swap order every repetition.
    if (request_off && i % 2 == 1) repetition(o, bytes, off_side, request_off);
    repetition(o, bytes, engine_side, request);
    if (request_off && i % 2 == 0) repetition(o, bytes, off_side, request_off);
    if (baseline) {
      repetition(o, bytes, base_side, [&] { best->run(local->regions(), src->regions()); });
    }
  }
  manager_off.reset();
  manager.reset();
  server.reset();
  if (!off_side.gbps.empty()) {
    const double off = make_stat(off_side.gbps).median;
    const double on = make_stat(engine_side.gbps).median;
    r.extra["gbps_no_epoch_check"] = off;
    if (off > 0) r.extra["epoch_check_cost_pct"] = (1.0 - on / off) * 100.0;
  }

  r.gbps = make_stat(engine_side.gbps);
  r.requests_per_s = make_stat(engine_side.rps).median;
  r.requests = engine_side.requests;
  r.p50_us = percentile(engine_side.latency_ns, 0.50) / 1e3;
  r.p99_us = percentile(engine_side.latency_ns, 0.99) / 1e3;
  if (!phases.prep.empty()) {
    r.prep_us = percentile(phases.prep, 0.5) / 1e3;
    r.post_us = percentile(phases.post, 0.5) / 1e3;
    r.transfer_us = percentile(phases.transfer, 0.5) / 1e3;
    if (phases.copies != 0) r.copies = phases.copies;
  }
  if (baseline) {
    const Stat b = make_stat(base_side.gbps);
    r.extra["memcpy"] = b.median;
    r.baseline_name = best->name();
    r.baseline_gbps = b;
    if (b.median > 0) r.ratio = r.gbps.median / b.median;
  }
  r.ok = true;
}

}  // namespace

CaseResult run_case(const EngineVariant& variant, const Workload& workload,
                    const RunOptions& options) {
  CaseResult r;
  r.engine = variant.name;
  r.workload = workload;
  try {
    run_case_inner(variant, workload, options, r);
  } catch (const Error& e) {
    r.ok = false;
    r.skipped = e.code() == StatusCode::kUnavailable;
    r.error = e.what();
  } catch (const std::exception& e) {
    r.ok = false;
    r.error = e.what();
  }
  return r;
}

}  // namespace mstar::kv::cli::bench
