// Copyright mstar-kv authors.
//
// Native engines, their futures, the planner and the pool. mstar_kv wraps
// these in the spec's Python classes; every call that can wait or copy
// releases the GIL.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mstar/kv/fault_injection.hpp"
#include "mstar/kv/local_only.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/planner.hpp"
#include "mstar/kv/pool.hpp"
#include "mstar/kv/stats.hpp"
#include "mstar/kv/streaming.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

namespace {

using std::chrono::milliseconds;

// One native engine. The cache it reads into is shared with the Python
// KVCache it was made from.
struct PyEngine {
  std::shared_ptr<KVCache> cache;  // null for the local-only engine
  std::unique_ptr<KVTransferEngine> engine;
  // Reads started through retrieve() (what KVTransferManager counts in C++).
  std::shared_ptr<TransferStatsRecorder> stats = std::make_shared<TransferStatsRecorder>("local");
  // The Python pool done notices free sequences in (kept alive here; the
  // engine's handler uses its native pool without the GIL).
  nb::object done_pool;
  // Layer-wise streams (streaming.hpp), made by the first stream_retrieve;
  // stopped by shutdown() before the engine.
  std::unique_ptr<LayerStreamer> streamer;
  milliseconds timeout{30000};

  KVTransferEngine& get(const char* what) const {
    if (!engine) {
      throw Error(StatusCode::kShutdown,
                  std::string(what) + " on an engine that was handed to a wrapper");
    }
    return *engine;
  }
};

}  // namespace

StreamOptions stream_options(double ready_timeout_s, double poll_interval_s,
                             std::uint32_t max_reads_in_flight) {
  if (!(ready_timeout_s >= 0) || ready_timeout_s > 86400 || !(poll_interval_s > 0) ||
      poll_interval_s > 1) {
    throw Error(StatusCode::kInvalidArgument,
                "ready_timeout " + std::to_string(ready_timeout_s) +
                    " s must be in [0, 86400] and poll_interval " +
                    std::to_string(poll_interval_s) + " s in (0, 1]");
  }
  StreamOptions o;
  o.ready_timeout = milliseconds(static_cast<std::int64_t>(ready_timeout_s * 1000 + 0.5));
  o.poll_interval = std::chrono::microseconds(
      std::max<std::int64_t>(1, static_cast<std::int64_t>(poll_interval_s * 1e6)));
  o.max_reads_in_flight = max_reads_in_flight;
  return o;
}

namespace {

EngineOptions make_options(std::uint32_t max_workers, double timeout_s,
                           const std::map<std::string, std::string>& extra) {
  if (!(timeout_s > 0) || timeout_s > 86400) {
    throw Error(StatusCode::kInvalidArgument,
                "timeout " + std::to_string(timeout_s) + " s out of range (0, 86400]");
  }
  EngineOptions o;
  o.max_workers = max_workers;
  o.timeout = milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0 + 0.5));
  if (o.timeout.count() == 0) o.timeout = milliseconds(1);
  o.extra = extra;
  return o;
}

std::optional<TransferFuture> read_release_gil(KVTransferEngine& e, const KVTransferInfo& info,
                                               const std::vector<KVReadInfo>& reads) {
  nb::gil_scoped_release release;
  return e.read_batched_async(info, reads);
}

// The native retrieve paths: `read(engine, local layout)` without the GIL,
// counted in the engine's stats.
template <typename Read>
std::optional<TransferFuture> retrieve_tracked(PyEngine& e, Read&& read) {
  KVTransferEngine& eng = e.get("start_async_retrieve");
  if (!e.cache) {
    throw Error(StatusCode::kInvalidArgument,
                "a local-only engine without a cache cannot retrieve");
  }
  nb::gil_scoped_release release;
  const KVLayout& layout = e.cache->layout();
  return TransferStatsRecorder::track(
      e.stats, [&]() -> std::optional<TransferFuture> { return read(eng, layout); });
}

std::vector<KVReadInfo> to_reads(nb::handle seq) {
  std::vector<KVReadInfo> out;
  const std::size_t n = nb::len(seq);
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    nb::handle item = seq[i];
    if (!nb::isinstance<KVReadInfo>(item)) {
      throw Error(StatusCode::kInvalidArgument,
                  "read_info[" + std::to_string(i) + "] is a " +
                      nb::cast<std::string>(nb::str(item.type().attr("__name__"))) +
                      ", not a KVReadInfo");
    }
    out.push_back(nb::cast<KVReadInfo>(item));
  }
  return out;
}

nb::dict peer_dict(const PeerStats& p) {
  nb::dict d;
  d["reads_started"] = p.reads_started;
  d["reads_succeeded"] = p.reads_succeeded;
  nb::dict failed;
  for (std::size_t c = 0; c < p.reads_failed.size(); ++c) {
    if (p.reads_failed[c] != 0) {
      failed[nb::str(std::string(to_string(static_cast<StatusCode>(c))).c_str())] =
          p.reads_failed[c];
    }
  }
  d["reads_failed"] = failed;
  d["bytes"] = p.bytes;
  d["copies"] = p.copies;
  nb::dict latency;
  for (std::size_t ph = 0; ph < p.latency.size(); ++ph) {
    const LatencyHistogram& h = p.latency[ph];
    nb::list buckets;  // (upper bound in seconds, cumulative count); inf last
    std::uint64_t cumulative = 0;
    for (std::size_t b = 0; b < h.buckets.size(); ++b) {
      cumulative += h.buckets[b];
      const double le = b < LatencyHistogram::kBounds.size()
                            ? LatencyHistogram::kBounds[b]
                            : std::numeric_limits<double>::infinity();
      buckets.append(nb::make_tuple(le, cumulative));
    }
    nb::dict hd;
    hd["count"] = h.count;
    hd["sum_seconds"] = h.sum_seconds;
    hd["buckets"] = buckets;
    latency[kPhaseNames[ph]] = hd;
  }
  d["latency"] = latency;
  return d;
}

nb::dict stats_dict(const TransferStats& s) {
  nb::dict d;
  d["engine"] = s.engine;
  d["total"] = peer_dict(s.total);
  nb::dict peers;
  for (const auto& [name, p] : s.peers) peers[nb::str(name.c_str())] = peer_dict(p);
  d["peers"] = peers;
  return d;
}

}  // namespace

void bind_engines(nb::module_& m) {
  nb::class_<TransferFuture>(m, "_Future",
                             "Native TransferFuture (mstar_kv.TransferFuture wraps it).")
      .def("ready", &TransferFuture::ready)
      .def(
          "wait",
          [](const TransferFuture& f, std::optional<double> timeout_s) {
            nb::gil_scoped_release release;
            if (!timeout_s) {
              f.wait();
              return true;
            }
            return f.wait_for(std::chrono::nanoseconds(
                static_cast<std::int64_t>(std::max(0.0, *timeout_s) * 1e9)));
          },
          nb::arg("timeout").none() = nb::none(),
          "Waits (GIL released); True once resolved.")
      .def("status",
           [](const TransferFuture& f) {
             const Status s = f.status();
             return std::make_tuple(static_cast<int>(s.code()), s.message());
           })
      .def_prop_ro("bytes", &TransferFuture::bytes)
      .def("cancel", &TransferFuture::cancel)
      .def(
          "on_resolved",
          [](const TransferFuture& f, nb::handle fn) {
            auto cb = std::make_shared<PyCallback>(fn);
            f.on_resolved([cb](const Status& s, std::uint64_t bytes) { cb->call_resolved(s, bytes); });
          },
          nb::arg("fn"),
          "fn(code: int, message: str, bytes: int) runs once on resolution, on the "
          "resolving thread with the GIL taken (now, if already resolved).");

  nb::class_<LayerStream>(m, "_LayerStream",
                          "Native LayerStream (mstar_kv.LayerStream wraps it).")
      .def("future", &LayerStream::future)
      .def_prop_ro("num_layers", &LayerStream::num_layers)
      .def_prop_ro("layers_done", &LayerStream::layers_done)
      .def(
          "wait_for_layer",
          [](const LayerStream& s, std::uint32_t layer, std::optional<double> timeout_s) {
            std::chrono::nanoseconds t = std::chrono::hours(24 * 365);
            if (timeout_s) {
              t = std::chrono::nanoseconds(
                  static_cast<std::int64_t>(std::max(0.0, std::min(*timeout_s, 1e8)) * 1e9));
            }
            Status st;
            {
              nb::gil_scoped_release release;
              st = s.wait_for_layer(layer, t);
            }
            return std::make_tuple(static_cast<int>(st.code()), st.message());
          },
          nb::arg("layer"), nb::arg("timeout").none() = nb::none(),
          "Waits (GIL released) for the layer: (code, message); IN_PROGRESS when the timeout "
          "passed first.")
      .def("cancel", &LayerStream::cancel);

  nb::class_<PyEngine>(m, "_Engine",
                       "A native engine (mstar_kv's engine classes wrap it). Safe from any "
                       "thread; shutdown() resolves reads in flight with SHUTDOWN.")
      .def_static(
          "make",
          [](const std::string& name, const PyKVCache& cache, const std::string& entity_id,
             const std::string& session_id, std::uint32_t max_workers, double timeout_s,
             const std::map<std::string, std::string>& extra) {
            TransferEngineInfo info{entity_id, session_id, name,
                                    make_options(max_workers, timeout_s, extra)};
            auto out = std::make_unique<PyEngine>();
            out->cache = cache.cache;
            out->stats = std::make_shared<TransferStatsRecorder>(name);
            out->timeout = info.options.timeout;
            nb::gil_scoped_release release;  // ucx opens a listener, mooncake starts
            out->engine = make_engine(info, out->cache);
            return out;
          },
          nb::arg("name"), nb::arg("kv_cache"), nb::arg("entity_id") = "",
          nb::arg("session_id") = "", nb::arg("max_workers") = 3, nb::arg("timeout") = 30.0,
          nb::arg("extra") = std::map<std::string, std::string>{},
          "Builds engine `name` ('local', 'shm', 'ucx', 'mooncake', 'cuda_ipc') over the "
          "cache through the library's factory.")
      .def_static("local_only",
                  [] {
                    auto out = std::make_unique<PyEngine>();
                    out->engine = std::make_unique<LocalOnlyKVTransferEngine>();
                    return out;
                  })
      .def_static(
          "fault_injecting",
          [](PyEngine& inner, double delay_s, bool drop, double drop_timeout_s) {
            if (!inner.cache) {
              throw Error(StatusCode::kInvalidArgument,
                          "the fault injector wraps an engine with a cache");
            }
            FaultConfig cfg;
            cfg.delay = milliseconds(static_cast<std::int64_t>(delay_s * 1000));
            cfg.drop = drop;
            cfg.drop_timeout = milliseconds(static_cast<std::int64_t>(drop_timeout_s * 1000));
            if (inner.streamer) inner.streamer->stop();  // it streams from the inner engine
            auto out = std::make_unique<PyEngine>();
            out->cache = inner.cache;
            out->stats = inner.stats;
            out->timeout = inner.timeout;
            out->engine = std::make_unique<FaultInjectingEngine>(std::move(inner.engine),
                                                                 inner.cache->layout(), cfg);
            return out;
          },
          nb::arg("inner"), nb::arg("delay") = 0.0, nb::arg("drop") = false,
          nb::arg("drop_timeout") = 1.0,
          "Wraps `inner` (which is consumed) in the library's FaultInjectingEngine.")
      .def("get_kv_transfer_info",
           [](const PyEngine& e) { return e.get("get_kv_transfer_info").get_kv_transfer_info(); })
      .def(
          "read_batched_async",
          [](PyEngine& e, nb::handle remote, nb::handle reads) {
            KVTransferInfo info = to_transfer_info(remote);
            std::vector<KVReadInfo> r = to_reads(reads);
            return read_release_gil(e.get("read_batched_async"), info, r);
          },
          nb::arg("remote_kv_info").none(), nb::arg("read_info"))
      .def(
          "remote_layout",
          [](PyEngine& e, nb::handle remote) -> std::optional<KVLayout> {
            return e.get("remote_layout").remote_layout(to_transfer_info(remote));
          },
          nb::arg("remote_kv_info").none(),
          "The layout the descriptor describes (validated), or None where the engine cannot "
          "tell.")
      .def(
          "retrieve",
          [](PyEngine& e, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle remote_pages, nb::handle remote) -> std::optional<TransferFuture> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            const auto rp = to_pages(remote_pages, "remote_page_indices");
            const KVTransferInfo info = to_transfer_info(remote);
            return retrieve_tracked(e, [&](KVTransferEngine& eng, const KVLayout& layout) {
              return eng.read_batched_async(
                  info, plan_retrieve(eng, layout, start_len, end_len, lp, rp, info));
            });
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("remote_page_indices"), nb::arg("kv_transfer_info").none(),
          "plan_retrieve + read_batched_async in one native call (caches of different "
          "geometry included).")
      .def(
          "retrieve_shards",
          [](PyEngine& e, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle shards) -> std::optional<TransferFuture> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            std::vector<RemoteShard> rs;
            const std::size_t n = nb::len(shards);
            for (std::size_t i = 0; i < n; ++i) {
              nb::handle item = shards[i];
              if (nb::len(item) != 2) {
                throw Error(StatusCode::kInvalidArgument,
                            "shards[" + std::to_string(i) +
                                "] must be (remote_page_indices, kv_transfer_info)");
              }
              rs.push_back({to_pages(item[0], "remote_page_indices"), to_transfer_info(item[1])});
            }
            return retrieve_tracked(e, [&](KVTransferEngine& eng, const KVLayout& layout) {
              return retrieve_shards(eng, layout, start_len, end_len, lp, rs);
            });
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("shards"),
          "retrieve_shards: each local head from the first shard that holds it, one future.")
      .def(
          "stream_retrieve",
          [](PyEngine& e, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle remote_pages, nb::handle remote, double ready_timeout_s,
             double poll_interval_s, std::uint32_t max_reads_in_flight) -> std::optional<LayerStream> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            const auto rp = to_pages(remote_pages, "remote_page_indices");
            KVTransferInfo info = to_transfer_info(remote);
            KVTransferEngine& eng = e.get("start_streaming_retrieve");
            if (!e.cache) {
              throw Error(StatusCode::kInvalidArgument,
                          "a local-only engine without a cache cannot stream");
            }
            const StreamOptions o =
                stream_options(ready_timeout_s, poll_interval_s, max_reads_in_flight);
            if (!e.streamer) e.streamer = std::make_unique<LayerStreamer>(eng, e.cache, e.timeout);
            LayerStreamer& streamer = *e.streamer;
            nb::gil_scoped_release release;
            std::optional<LayerStream> stream;
            TransferStatsRecorder::track(e.stats, [&]() -> std::optional<TransferFuture> {
              stream = streamer.start(start_len, end_len, lp, rp, info, o);
              if (!stream) return std::nullopt;
              return stream->future();
            });
            return stream;
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("remote_page_indices"), nb::arg("kv_transfer_info").none(),
          nb::arg("ready_timeout") = 0.0, nb::arg("poll_interval") = 20e-6,
          nb::arg("max_reads_in_flight") = 4,
          "Layer-wise streaming pull (KVTransferManager::start_streaming_retrieve); None when "
          "start_len == end_len.")
      .def("shutdown",
           [](PyEngine& e) {
             if (!e.engine) return;
             nb::gil_scoped_release release;
             if (e.streamer) e.streamer->stop();
             e.engine->shutdown();
           })
      .def(
          "notify_done",
          [](PyEngine& e, const SequenceInfo& seq) {
            KVTransferEngine& eng = e.get("notify_done");
            if (seq.kv_transfer_info.empty()) {
              throw Error(StatusCode::kInvalidArgument,
                          "done notice for sequence " + std::to_string(seq.seq_id) +
                              " with a local-only descriptor: there is no owner to tell");
            }
            nb::gil_scoped_release release;
            eng.notify_done(seq.kv_transfer_info, seq.seq_id);
          },
          nb::arg("seq"),
          "Tells the owner of `seq` this reader is done with it, over the engine's channel "
          "(UCX); UnavailableError for engines without one.")
      .def(
          "serve_done_notices",
          [](PyEngine& e, nb::handle pool) {
            KVTransferEngine& eng = e.get("serve_done_notices");
            if (pool.is_none()) {
              eng.set_done_handler(nullptr);
              e.done_pool = nb::object();
              return;
            }
            KVCachePool* p = nb::cast<KVCachePool*>(pool);
            e.done_pool = nb::borrow(pool);
            eng.set_done_handler([p](std::uint64_t seq_id, std::uint64_t epoch) {
              if (epoch != 0) p->done(seq_id, epoch);
            });
          },
          nb::arg("pool").none(),
          "Done notices arriving at this engine free the named sequence in `pool` (a native "
          "_Pool) if it still holds the notice's epoch; None stops.")
      .def_prop_ro("wrapped", [](const PyEngine& e) { return !e.engine; })
      .def("stats", [](const PyEngine& e) { return stats_dict(e.stats->snapshot()); },
           "Statistics of the reads started through retrieve(), as a dict (see "
           "mstar_kv.KVTransferManager.stats).")
      .def("prometheus", [](const PyEngine& e) { return render_prometheus({e.stats->snapshot()}); },
           "The same statistics in Prometheus text format.");

  m.def("built_engines", &built_engines, "Engines compiled into this build.");
  m.def(
      "cuda_unavailable_reason",
      []() -> std::string {
#if MSTAR_KV_PY_HAVE_CUDA_IPC
        nb::gil_scoped_release release;
        return cuda_unavailable_reason();
#else
        return "the cuda_ipc engine is not built into this mstar_kv";
#endif
      },
      "Empty when a CUDA device is usable here, else why not (with the CUDA error name).");

#if MSTAR_KV_PY_HAVE_CUDA_IPC
  m.def(
      "_mark_layers_ready_after",
      [](nb::handle pool, std::uint64_t seq_id, std::uint32_t layers, std::uintptr_t stream) {
        // Not owning: the Python KVCachePool keeps the pool alive (its
        // docstring says until the stream passed the mark); a decref on
        // CUDA's callback thread would need the GIL there.
        std::shared_ptr<KVCachePool> p(nb::cast<KVCachePool*>(pool), [](KVCachePool*) {});
        mark_layers_ready_after(std::move(p), seq_id, layers, reinterpret_cast<void*>(stream));
      },
      nb::arg("pool"), nb::arg("seq_id"), nb::arg("layers"), nb::arg("stream"),
      "KVCachePool.mark_layers_ready once `stream` (a cudaStream_t as an int) gets there.");
#endif

  m.def(
      "plan_reads",
      [](const KVLayout& local, std::uint64_t start_len, std::uint64_t end_len,
         nb::handle local_pages, nb::handle remote_pages, std::optional<KVLayout> remote,
         std::uint32_t head_lo, std::uint32_t head_hi) {
        const auto lp = to_pages(local_pages, "local_page_indices");
        const auto rp = to_pages(remote_pages, "remote_page_indices");
        if (remote) return plan_reads(local, *remote, start_len, end_len, lp, rp, head_lo, head_hi);
        return plan_reads(local, start_len, end_len, lp, rp);
      },
      nb::arg("local_layout"), nb::arg("start_len"), nb::arg("end_len"),
      nb::arg("local_page_indices"), nb::arg("remote_page_indices"),
      nb::arg("remote_layout").none() = nb::none(), nb::arg("head_lo") = 0,
      nb::arg("head_hi") = 0,
      "KVReadInfo per (layer, page) for tokens [start_len, end_len), first and last page "
      "clipped, in the local cache's order. With remote_layout, between caches of different "
      "geometry (page sizes, head shards; only model heads [head_lo, head_hi) when given).");

  m.def(
      "check_remote_pages",
      [](const KVLayout& local, const KVLayout& remote, std::uint64_t start_len,
         std::uint64_t end_len, nb::handle remote_pages) {
        check_remote_pages(local, remote, start_len, end_len,
                           to_pages(remote_pages, "remote_page_indices"));
      },
      nb::arg("local_layout"), nb::arg("remote_layout"), nb::arg("start_len"),
      nb::arg("end_len"), nb::arg("remote_page_indices"),
      "Layout compatibility and the remote page table entries tokens [start_len, end_len) "
      "touch, errors naming the table entry (planner.hpp).");

  m.def(
      "plan_copy_addresses",
      [](const KVLayout& local, std::uint64_t local_base, const KVLayout& remote,
         std::uint64_t remote_base, nb::handle reads, std::uint64_t max_bytes) {
        const std::vector<KVReadInfo> r = to_reads(reads);
        std::vector<std::uint64_t> la, ra, len;
        {
          nb::gil_scoped_release release;
          const CopyPlan plan = plan_copies(local, remote, r);
          const std::vector<CopySpan> spans =
              max_bytes ? split_spans(plan.spans, max_bytes) : plan.spans;
          la.reserve(spans.size());
          ra.reserve(spans.size());
          len.reserve(spans.size());
          for (const CopySpan& s : spans) {
            la.push_back(local_base + s.local_offset);
            ra.push_back(remote_base + s.remote_offset);
            len.push_back(s.length);
          }
        }
        return std::make_tuple(std::move(la), std::move(ra), std::move(len));
      },
      nb::arg("local_layout"), nb::arg("local_base"), nb::arg("remote_layout"),
      nb::arg("remote_base"), nb::arg("read_info"), nb::arg("max_bytes") = 0,
      "Validates the reads against both layouts (raising before anything is returned) and "
      "returns the coalesced copies as (local addresses, remote addresses, lengths), spans "
      "cut to at most max_bytes when it is not 0.");

  nb::class_<KVCachePool>(m, "_Pool", "Native KVCachePool (mstar_kv.KVCachePool wraps it).")
      .def(
          "__init__",
          [](KVCachePool* self, const PyKVCache& cache, const KVTransferInfo& descriptor,
             std::uint64_t scatter_seed, double lease_s) {
            if (!(lease_s >= 0) || lease_s > 1e9) {
              throw Error(StatusCode::kInvalidArgument,
                          "lease " + std::to_string(lease_s) +
                              " s out of range [0, 1e9] (0 = never expire)");
            }
            new (self) KVCachePool(cache.cache, descriptor, scatter_seed,
                                   milliseconds(static_cast<std::int64_t>(lease_s * 1000 + 0.5)));
          },
          nb::arg("kv_cache"), nb::arg("descriptor"), nb::arg("scatter_seed") = 0,
          nb::arg("lease") = 60.0)
      .def("done", &KVCachePool::done, nb::arg("seq_id"), nb::arg("epoch") = 0,
           nb::call_guard<nb::gil_scoped_release>())
      .def("expire_leases", &KVCachePool::expire_leases)
      .def_prop_ro("lease", [](const KVCachePool& p) { return p.lease().count() / 1000.0; })
      .def("expired_count", &KVCachePool::expired_count)
      .def("allocate", &KVCachePool::allocate, nb::arg("seq_id"), nb::arg("num_tokens"))
      .def("free", &KVCachePool::release, nb::arg("seq_id"))
      .def("contains", &KVCachePool::contains, nb::arg("seq_id"))
      .def("pages", &KVCachePool::pages, nb::arg("seq_id"))
      .def("free_page_count", &KVCachePool::free_page_count)
      .def(
          "publish",
          [](KVCachePool& p, std::uint64_t seq_id, std::optional<std::uint32_t> layers_ready) {
            return layers_ready ? p.publish(seq_id, *layers_ready) : p.publish(seq_id);
          },
          nb::arg("seq_id"), nb::arg("layers_ready").none() = nb::none())
      .def("mark_layers_ready", &KVCachePool::mark_layers_ready, nb::arg("seq_id"),
           nb::arg("layers_done"))
      .def("layers_ready", &KVCachePool::layers_ready, nb::arg("seq_id"));
}

}  // namespace mstar::kv::py
