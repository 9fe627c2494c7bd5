// Copyright mstar-kv authors.
//
// The one manager, bound: mstar_kv._core._Manager is the C++
// KVTransferManager over a native engine or a Python one (PyEngineBridge);
// mstar_kv.KVTransferManager adds only the Pythonic surface (futures,
// streams, the spec's constructor). Every call that can wait releases the
// GIL.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/core/requests.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/manager.hpp"
#include "py_common.hpp"
#include "py_engine.hpp"

namespace mstar::kv::py {

namespace {

struct PyManager {
  std::shared_ptr<KVTransferManager> mgr;
  PyEngineBridge* bridge = nullptr;  // when the engine is a Python object
  bool owns_engine = true;
  nb::object done_pool;  // the pool done notices free sequences in

  ~PyManager() {
    nb::gil_scoped_release release;  // the stream driver may wait for the GIL
    if (mgr && !owns_engine) mgr->detach();
    mgr.reset();
  }

  KVTransferManager& get() const { return *mgr; }

  // Opens the caller's descriptor as the Python engine does; called by the
  // manager without the GIL.
  KVTransferManager::RemoteOpener opener(nb::handle remote) const {
    return [b = bridge, remote] {
      nb::gil_scoped_acquire gil;
      return b->open_py(remote);
    };
  }
};

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
  nb::dict served;  // the owner side (stats.hpp, ServedStats)
  served["reads"] = s.served.reads;
  served["bytes"] = s.served.bytes;
  served["reads_refused"] = s.served.reads_refused;
  served["replies_dropped"] = s.served.replies_dropped;
  served["readers_connected"] = s.served.readers_connected;
  served["readers_gone"] = s.served.readers_gone;
  served["staged_bytes"] = s.served.staged_bytes;
  served["descriptors"] = s.served.descriptors;
  served["done_notices"] = s.served.done_notices;
  d["served"] = served;
  return d;
}

}  // namespace

void bind_manager(nb::module_& m) {
  nb::class_<PyManager>(m, "_Manager",
                        "The C++ KVTransferManager (mstar_kv.KVTransferManager wraps it).")
      .def(
          "__init__",
          [](PyManager* self, nb::handle engine, const PyKVCache& cache, double timeout_s,
             bool owns_engine, std::string resource_key, bool needs_remote_transfer) {
            new (self) PyManager();
            std::shared_ptr<KVTransferEngine> e;
            if (nb::isinstance<PyEngine>(engine)) {
              e = nb::cast<const PyEngine&>(engine).engine;
            } else {
              auto bridge = std::make_shared<PyEngineBridge>(nb::borrow(engine));
              self->bridge = bridge.get();
              e = std::move(bridge);
            }
            self->owns_engine = owns_engine;
            const auto timeout = seconds_option("timeout", timeout_s);
            nb::gil_scoped_release release;
            self->mgr = std::make_shared<KVTransferManager>(
                cache.cache, std::move(e), timeout,
                ResourceScope{std::move(resource_key), needs_remote_transfer});
          },
          nb::arg("engine"), nb::arg("kv_cache"), nb::arg("timeout") = 30.0,
          nb::arg("owns_engine") = true, nb::arg("resource_key") = "kv",
          nb::arg("needs_remote_transfer") = true,
          "Around a native engine (_Engine) or any Python object with the KVTransferEngine "
          "methods; `timeout` is the engine's read timeout (streams' default "
          "ready_timeout). A manager that does not own its engine leaves it running when it "
          "is dropped (cleanup() still shuts it down).")
      .def_prop_ro("closed", [](const PyManager& p) { return p.get().closed(); })
      .def_prop_ro("resource_key", [](const PyManager& p) { return p.get().scope().resource_key; })
      .def_prop_ro("needs_remote_transfer",
                   [](const PyManager& p) { return p.get().scope().needs_remote_transfer; })
      .def(
          "publish",
          [](PyManager& p, std::string request_id, std::string label, nb::handle pages,
             std::uint64_t seq_len,
             std::optional<std::int64_t> generation) -> std::optional<RequestKVTransferInfo> {
            RequestPublication pub{std::move(request_id), std::move(label),
                                   to_pages(pages, "page_indices"), seq_len, generation};
            nb::gil_scoped_release release;  // a Python engine's descriptor takes the GIL
            return p.get().get_kv_transfer_info(pub);
          },
          nb::arg("request_id"), nb::arg("label"), nb::arg("page_indices"), nb::arg("seq_len"),
          nb::arg("reset_generation").none() = nb::none(),
          "KVTransferManager::get_kv_transfer_info(RequestPublication): the request's "
          "descriptor, or None where nothing is published.")
      .def(
          "owns_transfer_info",
          [](const PyManager& p, const RequestKVTransferInfo& info, std::string_view request_id,
             std::string_view label) {
            return p.get().owns_transfer_info(info, request_id, label);
          },
          nb::arg("info"), nb::arg("request_id"), nb::arg("label"))
      .def(
          "remove_request",
          [](PyManager& p, std::string_view request_id) { p.get().remove_request(request_id); },
          nb::arg("request_id"))
      .def(
          "read_request_async",
          [](PyManager& p, const RequestKVTransferInfo& info,
             nb::handle reads) -> std::optional<TransferFuture> {
            const std::vector<KVReadInfo> r = to_reads(reads);
            nb::gil_scoped_release release;
            return p.get().read_request_async(info, r);
          },
          nb::arg("info"), nb::arg("read_info"))
      .def(
          "start_async_retrieve",
          [](PyManager& p, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle remote_pages, nb::handle remote) -> std::optional<TransferFuture> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            const auto rp = to_pages(remote_pages, "remote_page_indices");
            KVTransferManager& mgr = p.get();
            if (nb::isinstance<RequestKVTransferInfo>(remote)) {
              const auto& info = nb::cast<const RequestKVTransferInfo&>(remote);
              nb::gil_scoped_release release;
              return mgr.start_async_retrieve_request(start_len, end_len, lp, rp, info);
            }
            if (p.bridge == nullptr) {
              KVTransferInfo info = to_transfer_info(remote);
              nb::gil_scoped_release release;
              return mgr.start_async_retrieve(start_len, end_len, lp, rp, info);
            }
            const auto open = p.opener(remote);
            nb::gil_scoped_release release;
            return mgr.start_async_retrieve_from(start_len, end_len, lp, rp, open);
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("remote_page_indices"), nb::arg("kv_transfer_info").none())
      .def(
          "start_async_retrieve_shards",
          [](PyManager& p, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle shards) -> std::optional<TransferFuture> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            std::vector<RemoteShard> rs;
            const std::size_t n = nb::len(shards);
            for (std::size_t i = 0; i < n; ++i) {
              nb::handle item = shards[i];
              if (nb::hasattr(item, "page_indices") && nb::hasattr(item, "kv_transfer_info")) {
                rs.push_back({to_pages(item.attr("page_indices"), "page_indices"),
                              to_transfer_info(item.attr("kv_transfer_info"))});
                continue;
              }
              if (!nb::isinstance<nb::sequence>(item) || nb::len(item) != 2) {
                throw Error(StatusCode::kInvalidArgument,
                            "shards[" + std::to_string(i) +
                                "] must be a SequenceInfo or (remote_page_indices, "
                                "kv_transfer_info)");
              }
              rs.push_back({to_pages(item[0], "remote_page_indices"), to_transfer_info(item[1])});
            }
            nb::gil_scoped_release release;
            return p.get().start_async_retrieve(start_len, end_len, lp, rs);
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("shards"))
      .def(
          "start_streaming_retrieve",
          [](PyManager& p, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle remote_pages, nb::handle remote, double ready_timeout_s,
             double poll_interval_s,
             std::uint32_t max_reads_in_flight) -> std::optional<LayerStream> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            const auto rp = to_pages(remote_pages, "remote_page_indices");
            const StreamOptions o =
                stream_options(ready_timeout_s, poll_interval_s, max_reads_in_flight);
            KVTransferManager& mgr = p.get();
            if (p.bridge == nullptr) {
              KVTransferInfo info = to_transfer_info(remote);
              nb::gil_scoped_release release;
              return mgr.start_streaming_retrieve(start_len, end_len, lp, rp, info, o);
            }
            const auto open = p.opener(remote);
            nb::gil_scoped_release release;
            return mgr.start_streaming_retrieve_from(start_len, end_len, lp, rp, open, o);
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("remote_page_indices"), nb::arg("kv_transfer_info").none(),
          nb::arg("ready_timeout") = 0.0, nb::arg("poll_interval") = 20e-6,
          nb::arg("max_reads_in_flight") = 4)
      .def(
          "connect",
          [](PyManager& p, nb::handle remote) {
            // A Python engine has nothing to open ahead (KVTransferEngine::connect).
            if (p.bridge != nullptr) return;
            KVTransferInfo info = to_transfer_info(remote);
            nb::gil_scoped_release release;
            p.get().connect(info);
          },
          nb::arg("kv_transfer_info"),
          "Opens what pulls from this descriptor's owner need (ucx: the connection; shm: the "
          "mapping) before the first one; at most the engine's timeout; raises what that pull "
          "would have raised there. Moves no byte.")
      .def(
          "notify_done",
          [](PyManager& p, const SequenceInfo& seq) {
            nb::gil_scoped_release release;
            p.get().notify_done(seq);
          },
          nb::arg("seq"))
      .def(
          "serve_done_notices",
          [](PyManager& p, nb::handle pool) {
            if (pool.is_none()) {
              p.get().serve_done_notices(nullptr);
              p.done_pool = nb::object();
              return;
            }
            const PyPool& pp = nb::cast<const PyPool&>(pool);
            p.get().serve_done_notices(pp.pool);
            p.done_pool = nb::borrow(pool);  // the manager holds it weakly
          },
          nb::arg("pool").none())
      .def("stats", [](const PyManager& p) { return stats_dict(p.get().stats()); })
      .def("prometheus", [](const PyManager& p) { return render_prometheus({p.get().stats()}); })
      .def(
          "set_stats_enabled",
          [](PyManager& p, bool enabled) { p.get().set_stats_enabled(enabled); },
          nb::arg("enabled"))
      .def("cleanup", [](PyManager& p) {
        nb::gil_scoped_release release;
        p.get().cleanup();
      });
}

}  // namespace mstar::kv::py
