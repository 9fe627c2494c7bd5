// Copyright mstar-kv authors.
//
// Google Benchmark micro-benchmarks of read planning and coalescing: one
// request of Llama-3-8B geometry (32 layers, 8 KV heads, head dim 128, bf16,
// 16-token pages) and 128k tokens, i.e. 8192 pages and 262,144 KVReadInfo.
// The counter per_read is the CPU time per KVReadInfo (per (layer, page)).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/core/planner.hpp"

namespace {

using namespace mstar::kv;

constexpr std::uint64_t kTokens = 128 * 1024;

KVLayout llama3_8b(std::uint64_t tokens, CacheOrder co, PageOrder po) {
  return {.num_layers = 32,
          .num_pages = static_cast<std::uint32_t>((tokens + 15) / 16),
          .page_size = 16,
          .num_kv_heads = 8,
          .head_dim = 128,
          .dtype = DType::kBFloat16,
          .cache_order = co,
          .page_order = po};
}

std::vector<std::uint32_t> page_table(std::uint32_t pages, bool scattered, std::uint64_t seed) {
  std::vector<std::uint32_t> t(pages);
  std::iota(t.begin(), t.end(), 0u);
  if (scattered) {
    std::mt19937_64 gen(seed);
    std::shuffle(t.begin(), t.end(), gen);
  }
  return t;
}

struct Request {
  KVLayout local, remote;
  std::vector<std::uint32_t> local_pages, remote_pages;
  std::uint64_t start = 0, end = 0;
};

// range(0): scattered; range(1): cache order (0 layer, 1 page, 2
// layer_page); range(2): in-page case
// (0 NHD, 1 HND, 2 HND with a prefix hit ending mid-page, 3 NHD <- HND).
Request request(const benchmark::State& state) {
  const bool scattered = state.range(0) != 0;
  const auto co = static_cast<CacheOrder>(state.range(1));
  const int in_page = static_cast<int>(state.range(2));
  // NHD <- HND moves every (token, head) row on its own: 67M spans at 128k
  // tokens would not fit comfortably, so that case plans 4096 tokens.
  const std::uint64_t tokens = in_page == 3 ? 4096 : kTokens;
  Request r;
  const PageOrder lpo = in_page == 0 || in_page == 3 ? PageOrder::kNHD : PageOrder::kHND;
  const PageOrder rpo = in_page == 0 ? PageOrder::kNHD : PageOrder::kHND;
  r.local = llama3_8b(tokens, co, lpo);
  r.remote = llama3_8b(tokens, co, rpo);
  r.local_pages = page_table(r.local.num_pages, scattered, 1);
  r.remote_pages = page_table(r.remote.num_pages, scattered, 2);
  r.start = in_page == 2 ? 1000 : 0;  // 1000 = 62.5 pages: a partial first page
  r.end = tokens;
  return r;
}

void set_counters(benchmark::State& state, std::size_t reads, const CopyPlan* plan) {
  state.counters["reads"] = static_cast<double>(reads);
  // Seconds per read; the console prints it with an SI prefix ("31.2ns").
  state.counters["per_read"] =
      benchmark::Counter(static_cast<double>(reads), benchmark::Counter::kIsIterationInvariantRate |
                                                         benchmark::Counter::kInvert);
  if (plan != nullptr) {
    state.counters["copies"] = static_cast<double>(plan->spans.size());
    state.counters["uncoalesced"] = static_cast<double>(plan->uncoalesced_spans);
  }
}

void BM_PlanReads(benchmark::State& state) {
  const Request r = request(state);
  std::size_t n = 0;
  for (auto _ : state) {
    auto reads = plan_reads(r.local, r.start, r.end, r.local_pages, r.remote_pages);
    n = reads.size();
    benchmark::DoNotOptimize(reads.data());
  }
  set_counters(state, n, nullptr);
}

void BM_PlanCopies(benchmark::State& state) {
  const Request r = request(state);
  const auto reads = plan_reads(r.local, r.start, r.end, r.local_pages, r.remote_pages);
  CopyPlan last;
  for (auto _ : state) {
    CopyPlan plan = plan_copies(r.local, r.remote, reads);
    benchmark::DoNotOptimize(plan.spans.data());
    last = std::move(plan);
  }
  set_counters(state, reads.size(), &last);
}

// What the manager does per request: plan_reads then plan_copies.
void BM_PlanRequest(benchmark::State& state) {
  const Request r = request(state);
  CopyPlan last;
  std::size_t n = 0;
  for (auto _ : state) {
    const auto reads = plan_reads(r.local, r.start, r.end, r.local_pages, r.remote_pages);
    CopyPlan plan = plan_copies(r.local, r.remote, reads);
    benchmark::DoNotOptimize(plan.spans.data());
    n = reads.size();
    last = std::move(plan);
  }
  set_counters(state, n, &last);
}

// Splitting coalesced spans for a worker pool (1 MiB pieces).
void BM_SplitSpans(benchmark::State& state) {
  const Request r = request(state);
  const auto reads = plan_reads(r.local, r.start, r.end, r.local_pages, r.remote_pages);
  const CopyPlan plan = plan_copies(r.local, r.remote, reads);
  for (auto _ : state) {
    auto pieces = split_spans(plan.spans, 1u << 20);
    benchmark::DoNotOptimize(pieces.data());
  }
  set_counters(state, reads.size(), &plan);
}

// The CPU work the page epoch checks add to one request (epochs.hpp), on
// the Llama-3-8B request of range(0) tokens, scattered: the reader collects
// the request's remote pages (remote_pages_of), the owner (UCX am) or the
// reader (shm, gets) checks them before and after the copy. Besides this,
// UCX sends the page list in the read request (4 bytes a page) and the
// owner answers with one small eager message once its sends completed.
void BM_EpochChecks(benchmark::State& state) {
  const std::uint64_t tokens = static_cast<std::uint64_t>(state.range(0));
  const KVLayout l = llama3_8b(tokens, CacheOrder::kLayerMajor, PageOrder::kNHD);
  const auto local = page_table(l.num_pages, true, 1);
  const auto remote = page_table(l.num_pages, true, 2);
  const auto reads = plan_reads(l, 0, tokens, local, remote);
  std::vector<std::uint64_t> table(l.num_pages, 77);
  for (auto _ : state) {
    const auto pages = remote_pages_of(reads, l.num_pages);
    Status before = check_page_epochs(table.data(), l.num_pages, pages, 77, "before", false);
    Status after = check_page_epochs(table.data(), l.num_pages, pages, 77, "after", true);
    benchmark::DoNotOptimize(before);
    benchmark::DoNotOptimize(after);
  }
  set_counters(state, reads.size(), nullptr);
  state.counters["pages"] = static_cast<double>(l.num_pages);
}

void args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"scattered", "cache_order", "in_page"});
  for (int scattered : {0, 1}) {
    for (int order : {0, 1, 2}) {
      for (int in_page : {0, 1, 2}) b->Args({scattered, order, in_page});
    }
  }
  b->Unit(benchmark::kMillisecond);
}

void args_mismatch(benchmark::internal::Benchmark* b) {
  b->ArgNames({"scattered", "cache_order", "in_page"});
  b->Args({1, 0, 3});
  b->Args({1, 1, 3});
  b->Args({1, 2, 3});
  b->Unit(benchmark::kMillisecond);
}

void args_split(benchmark::internal::Benchmark* b) {
  b->ArgNames({"scattered", "cache_order", "in_page"});
  b->Args({0, 0, 0});
  b->Args({1, 0, 0});
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_PlanReads)->Apply(args);
BENCHMARK(BM_PlanCopies)->Apply(args);
BENCHMARK(BM_PlanCopies)->Apply(args_mismatch);
BENCHMARK(BM_PlanRequest)->Apply(args);
BENCHMARK(BM_SplitSpans)->Apply(args_split);
BENCHMARK(BM_EpochChecks)
    ->ArgName("tokens")
    ->Arg(4096)
    ->Arg(kTokens)
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
