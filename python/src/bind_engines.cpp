// Copyright mstar-kv authors.
//
// Native engines, futures, layer streams and watches, and the planner.
// mstar_kv wraps these in the spec's Python classes; every call that can
// wait or copy releases the GIL.
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

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/engines/fault_injection.hpp"
#include "mstar/kv/engines/local_only.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/streaming.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

using std::chrono::milliseconds;

milliseconds seconds_option(const char* name, double seconds, bool zero_ok) {
  if (!(zero_ok ? seconds >= 0 : seconds > 0) || seconds > 86400) {
    throw Error(StatusCode::kInvalidArgument, std::string(name) + " " + std::to_string(seconds) +
                                                  " s out of range " + (zero_ok ? "[0" : "(0") +
                                                  ", 86400]");
  }
  const auto ms = milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
  return ms.count() == 0 && !zero_ok ? milliseconds(1) : ms;
}

StreamOptions stream_options(double ready_timeout_s, double poll_interval_s,
                             std::uint32_t max_reads_in_flight) {
  if (!(ready_timeout_s >= 0) || ready_timeout_s > 86400 || !(poll_interval_s > 0) ||
      poll_interval_s > 1) {
    throw Error(StatusCode::kInvalidArgument, "ready_timeout " + std::to_string(ready_timeout_s) +
                                                  " s must be in [0, 86400] and poll_interval " +
                                                  std::to_string(poll_interval_s) + " s in (0, 1]");
  }
  StreamOptions o;
  o.ready_timeout = seconds_option("ready_timeout", ready_timeout_s, /*zero_ok=*/true);
  o.poll_interval = std::chrono::microseconds(
      std::max<std::int64_t>(1, static_cast<std::int64_t>(poll_interval_s * 1e6)));
  o.max_reads_in_flight = max_reads_in_flight;
  return o;
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

namespace {

EngineOptions make_options(std::uint32_t max_workers, double timeout_s,
                           const std::map<std::string, std::string>& extra) {
  EngineOptions o;
  o.max_workers = max_workers;
  o.timeout = seconds_option("timeout", timeout_s);
  o.extra = extra;
  return o;
}

KVTransferEngine& engine_of(const PyEngine& e) { return *e.engine; }

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
          nb::arg("timeout").none() = nb::none(), "Waits (GIL released); True once resolved.")
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
            f.on_resolved(
                [cb](const Status& s, std::uint64_t bytes) { cb->call_resolved(s, bytes); });
          },
          nb::arg("fn"),
          "fn(code: int, message: str, bytes: int) runs once on resolution, on the "
          "resolving thread with the GIL taken (now, if already resolved).");

  nb::class_<LayerStream>(m, "_LayerStream", "Native LayerStream (mstar_kv.LayerStream wraps it).")
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

  nb::class_<LayerWatch>(m, "_LayerWatch", "A native engine's watch on an owner's layer readiness.")
      .def(
          "poll",
          [](LayerWatch& w) {
            std::uint32_t layers = 0;
            Status s;
            {
              nb::gil_scoped_release release;
              s = w.poll(&layers);
            }
            if (!s.is_ok()) throw Error(std::move(s));
            return layers;
          },
          "Layers ready on every watched page (never fewer than before); raises the stream's "
          "error (StaleDescriptorError, CorruptDescriptorError, the owner gone).");

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
                    out->engine = std::make_shared<LocalOnlyKVTransferEngine>();
                    return out;
                  })
      .def_static(
          "fault_injecting",
          [](const PyEngine& inner, double delay_s, bool drop, double drop_timeout_s) {
            if (!inner.cache) {
              throw Error(StatusCode::kInvalidArgument,
                          "the fault injector wraps an engine with a cache");
            }
            FaultConfig cfg;
            cfg.delay = seconds_option("delay", delay_s, /*zero_ok=*/true);
            cfg.drop = drop;
            cfg.drop_timeout = seconds_option("drop_timeout", drop_timeout_s);
            auto out = std::make_unique<PyEngine>();
            out->cache = inner.cache;
            out->timeout = inner.timeout;
            out->engine =
                std::make_shared<FaultInjectingEngine>(inner.engine, inner.cache->layout(), cfg);
            return out;
          },
          nb::arg("inner"), nb::arg("delay") = 0.0, nb::arg("drop") = false,
          nb::arg("drop_timeout") = 1.0,
          "Wraps `inner` in the library's FaultInjectingEngine (which shuts it down with "
          "itself).")
      .def("get_kv_transfer_info",
           [](const PyEngine& e) { return engine_of(e).get_kv_transfer_info(); })
      .def(
          "read_batched_async",
          [](PyEngine& e, nb::handle remote, nb::handle reads) {
            KVTransferInfo info = to_transfer_info(remote);
            std::vector<KVReadInfo> r = to_reads(reads);
            nb::gil_scoped_release release;
            return engine_of(e).read_batched_async(info, r);
          },
          nb::arg("remote_kv_info").none(), nb::arg("read_info"))
      .def(
          "remote_layout",
          [](PyEngine& e, nb::handle remote) -> std::optional<KVLayout> {
            return engine_of(e).remote_layout(to_transfer_info(remote));
          },
          nb::arg("remote_kv_info").none(),
          "The layout the descriptor describes (validated), or None where the engine cannot "
          "tell.")
      .def(
          "watch_layers",
          [](PyEngine& e, nb::handle remote, nb::handle reads) {
            KVTransferInfo info = to_transfer_info(remote);
            std::vector<KVReadInfo> r = to_reads(reads);
            nb::gil_scoped_release release;
            KVTransferEngine& eng = engine_of(e);
            return eng.watch_layers(*eng.open_remote(info), r);
          },
          nb::arg("remote_kv_info").none(), nb::arg("read_info"),
          "A watch on the owner's layer readiness for the remote pages of the reads "
          "(NotSupportedError for engines without a readiness channel).")
      .def(
          "notify_done",
          [](PyEngine& e, nb::handle remote, std::uint64_t seq_id) {
            KVTransferInfo info = to_transfer_info(remote);
            nb::gil_scoped_release release;
            KVTransferEngine& eng = engine_of(e);
            eng.notify_done(*eng.open_remote(info), seq_id);
          },
          nb::arg("remote_kv_info"), nb::arg("seq_id"),
          "Tells the owner of the descriptor this reader is done with seq_id, over the "
          "engine's channel (UCX); NotSupportedError for engines without one.")
      .def("shutdown", [](PyEngine& e) {
        nb::gil_scoped_release release;
        e.engine->shutdown();
      });

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
      nb::arg("remote_layout").none() = nb::none(), nb::arg("head_lo") = 0, nb::arg("head_hi") = 0,
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
      nb::arg("local_layout"), nb::arg("remote_layout"), nb::arg("start_len"), nb::arg("end_len"),
      nb::arg("remote_page_indices"),
      "Layout compatibility and the remote page table entries tokens [start_len, end_len) "
      "touch, errors naming the table entry (planner.hpp).");

  m.def(
      "plan_copy_addresses",
      [](const KVLayout& local, std::uint64_t local_base, const KVLayout& remote,
         std::uint64_t remote_base, nb::handle reads, std::uint64_t max_bytes,
         std::vector<std::uint64_t> local_regions, std::vector<std::uint64_t> remote_regions) {
        const std::vector<KVReadInfo> r = to_reads(reads);
        std::vector<std::uint64_t> la, ra, len;
        // One region per layer on a side: its layers' addresses (the spans
        // never cross a layer of a layer-contiguous cache).
        const RegionMap lmap = local_regions.empty()
                                   ? RegionMap::contiguous(local_base)
                                   : RegionMap::per_layer(local, std::move(local_regions));
        const RegionMap rmap = remote_regions.empty()
                                   ? RegionMap::contiguous(remote_base)
                                   : RegionMap::per_layer(remote, std::move(remote_regions));
        {
          nb::gil_scoped_release release;
          const CopyPlan plan = plan_copies(local, remote, r);
          const std::vector<CopySpan> spans =
              max_bytes ? split_spans(plan.spans, max_bytes) : plan.spans;
          la.reserve(spans.size());
          ra.reserve(spans.size());
          len.reserve(spans.size());
          for (const CopySpan& s : spans) {
            la.push_back(lmap.address(s.local_offset));
            ra.push_back(rmap.address(s.remote_offset));
            len.push_back(s.length);
          }
        }
        return std::make_tuple(std::move(la), std::move(ra), std::move(len));
      },
      nb::arg("local_layout"), nb::arg("local_base"), nb::arg("remote_layout"),
      nb::arg("remote_base"), nb::arg("read_info"), nb::arg("max_bytes") = 0,
      nb::arg("local_regions") = std::vector<std::uint64_t>{},
      nb::arg("remote_regions") = std::vector<std::uint64_t>{},
      "Validates the reads against both layouts (raising before anything is returned) and "
      "returns the coalesced copies as (local addresses, remote addresses, lengths), spans "
      "cut to at most max_bytes when it is not 0. A side given as per-layer region "
      "addresses (*_regions, one per layer) maps each copy through its layer's region.");
}

}  // namespace mstar::kv::py
