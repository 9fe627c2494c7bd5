// Copyright mstar-kv authors.
//
// What `mstar-kv bench` measures: workloads (one request's pages, from real
// model geometry or raw piece/batch sweeps), the engine variants that move
// them, and the results. Plain data; not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "layout_args.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/factory.hpp"

namespace mstar::kv::cli::bench {

enum class PageTable : std::uint8_t {
  kContiguous,  // pages 0, 1, 2, ... on both sides: coalesces into few copies
  kScattered,   // shuffled free lists (KVCachePool with a scatter seed)
  kStride2,     // pages 0, 2, 4, ... on both sides: never coalesces (raw sweeps)
};
const char* to_string(PageTable t) noexcept;

struct Workload {
  std::string name;          // "llama3-8b/p16/t4096/scattered"
  std::string group;         // "model", "piece" (raw piece-size sweep), "batch" (raw batch sweep)
  std::string model;         // preset name, or "raw"
  KVLayout local;            // num_pages filled in
  KVLayout remote;           // same geometry; orders may differ
  std::uint64_t tokens = 0;  // sequence length
  std::uint64_t start_len = 0;  // prefix already cached (not read)
  PageTable table = PageTable::kScattered;
  std::uint64_t piece_bytes = 0;  // raw sweeps: bytes of one read
  std::uint32_t batch = 0;        // raw sweeps: reads per request
  // Default suite only: a large request run on the same-host engines (local,
  // shm, cuda_ipc) only, so that the suite stays within its time budget.
  bool same_host_only = false;

  std::uint64_t bytes_per_request() const;  // what one retrieve moves
  // The two caches differ in page size, head shard or in-page order: the
  // memcpy baseline then copies the same bytes laid out contiguously.
  bool mixed_geometry() const;
};

// The same request between two caches of the local geometry (`NAME/plain`):
// what a mixed-geometry case costs against moving the same bytes unconverted.
Workload plain_twin(const Workload& w);

// Applies a remote geometry (layout_args.hpp) to a model workload.
void set_geometry(Workload& w, const Geometry& g);

// The remote layout's page table for a workload (entry i = sequence page i).
std::vector<std::uint32_t> remote_page_table(const Workload& w);
// The local page table (a different shuffle than the remote one).
std::vector<std::uint32_t> local_page_table(const Workload& w);

// A model workload. Throws Error on a bad preset or geometry.
Workload model_workload(const std::string& model, std::uint32_t page_size, std::uint64_t tokens,
                        PageTable table, double prefix_hit,
                        CacheOrder local_co = CacheOrder::kLayerMajor,
                        CacheOrder remote_co = CacheOrder::kLayerMajor,
                        PageOrder local_po = PageOrder::kNHD,
                        PageOrder remote_po = PageOrder::kNHD);
// A raw workload: `batch` reads of `piece_bytes` each (a multiple of 4096,
// 4 KiB .. 64 MiB), never coalescing: one layer, no V, 16-token pages of
// piece_bytes/4096 heads of 128 bf16, stride-2 page tables.
Workload raw_workload(std::uint64_t piece_bytes, std::uint32_t batch, const std::string& group);

// Named sets: "tiny" (the smoke test), "default" (< 2 minutes here), "full".
std::vector<Workload> suite(const std::string& name);

// One way of moving the bytes: an engine plus how its two sides are set up.
struct EngineVariant {
  std::string name;    // its loopback setup (EngineTraits::loopback): "ucx-tcp", ...
  std::string engine;  // the TransferEngineInfo::transfer_engine name
  MemoryKind remote_kind = MemoryKind::kHost;
  MemoryKind local_kind = MemoryKind::kHost;
  bool remote_in_child = true;               // the remote cache lives in another process
  std::map<std::string, std::string> env;    // set in the server and the client
  std::map<std::string, std::string> extra;  // EngineOptions::extra for this variant
  bool memcpy_baseline = true;               // also run the memcpy baseline
  bool crosses_hosts = false;                // the engine's peers may be on other hosts
  bool over_tcp = false;                     // its bytes cross a TCP socket
  // Both caches one region per layer (LoopbackSetup::layer_regions).
  bool layer_regions = false;
};

// Every loopback setup (EngineTraits::loopback) of every built engine.
std::vector<EngineVariant> engine_variants(const std::vector<EngineTraits>& engines);

struct Stat {
  double median = 0, min = 0, max = 0;
};
Stat make_stat(std::vector<double> values);

struct CaseResult {
  std::string engine;  // variant name
  Workload workload;
  bool ok = false;
  std::string error;  // when !ok: why (skipped or failed)
  bool skipped = false;
  Stat gbps;                  // per repetition
  double requests_per_s = 0;  // median over repetitions
  double p50_us = 0, p99_us = 0;
  // Medians per phase of the engine's requests (TransferTiming, the split
  // nixlbench prints): prep = validate + plan, post = until the last byte
  // range was handed over, transfer = until the future resolved. Absent for
  // the local baseline-only variant.
  std::optional<double> prep_us, post_us, transfer_us;
  std::uint64_t requests = 0;  // measured (not counting warm-up)
  std::uint64_t reads = 0;     // KVReadInfo per request
  std::uint64_t copies = 0;    // spans the engine planned (a strided span counts once)
  std::uint64_t uncoalesced = 0;
  std::uint64_t piece_bytes = 0;  // median copy span
  bool verified = false;
  std::string baseline_name;
  std::optional<Stat> baseline_gbps;
  std::optional<double> ratio;          // gbps.median / baseline median
  std::map<std::string, double> extra;  // other references, GB/s
  double wall_s = 0;                    // time the case took, setup and baseline included
};

}  // namespace mstar::kv::cli::bench
