// Copyright mstar-kv authors.
//
// KVCachePool, bound as mstar_kv.KVCachePool: page allocation per sequence
// over one KVCache, epochs and leases, publish() and layer readiness.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "mstar/kv/core/pool.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

namespace {

// The descriptor a pool stamps: what callers hold (a KVTransferManager,
// whose descriptor is taken, a KVTransferInfo, an engine's typed info, its
// bytes, or None for local-only).
KVTransferInfo pool_descriptor(nb::handle obj) {
  if (!obj.is_none() && !nb::isinstance<KVTransferInfo>(obj) &&
      nb::hasattr(obj, "get_kv_transfer_info")) {
    nb::object info = obj.attr("get_kv_transfer_info")();
    return info.is_none() ? KVTransferInfo{} : to_transfer_info(info);
  }
  try {
    return to_transfer_info(obj);
  } catch (const Error&) {
    throw Error(StatusCode::kInvalidArgument,
                "kv_transfer_info of type " +
                    nb::cast<std::string>(nb::str(obj.type().attr("__name__"))) +
                    " is not a descriptor (a KVTransferManager, a KVTransferInfo or an engine's "
                    "info)");
  }
}

}  // namespace

void bind_pool(nb::module_& m) {
  nb::class_<PyPool>(
      m, "KVCachePool",
      "Page allocation per sequence over one KVCache, and publish().\n\n"
      "KVCachePool(kv_cache, kv_transfer_info=None, scatter_seed=0, lease=60.0): "
      "kv_transfer_info (a KVTransferManager, whose descriptor is taken, a KVTransferInfo or "
      "an engine's typed info) is stamped onto every published SequenceInfo. scatter_seed != "
      "0 shuffles the free list deterministically. Safe from any thread. Exhaustion raises "
      "RetryLaterError; unknown sequences, double allocation and double frees raise "
      "InvalidArgumentError.\n\n"
      "Epochs and leases: every allocation stamps its pages with a fresh epoch that the "
      "published SequenceInfo carries, so a reader whose pages were freed or reused gets "
      "StaleDescriptorError, never another request's KV. A published sequence is freed "
      "`lease` seconds (default 60; 0 = never) after its first publish unless done()/free() "
      "freed it first; expired leases are reaped by expire_leases() and by allocate/publish.")
      .def(
          "__init__",
          [](PyPool* self, nb::handle cache, nb::handle kv_transfer_info,
             std::uint64_t scatter_seed, double lease_s) {
            if (!nb::isinstance<PyKVCache>(cache)) {
              throw Error(StatusCode::kInvalidArgument,
                          "kv_cache of type " +
                              nb::cast<std::string>(nb::str(cache.type().attr("__name__"))) +
                              " is not an mstar_kv.KVCache");
            }
            if (!(lease_s >= 0) || lease_s > 1e9) {
              throw Error(StatusCode::kInvalidArgument,
                          "lease " + std::to_string(lease_s) +
                              " s out of range [0, 1e9] (0 = never expire)");
            }
            const KVTransferInfo descriptor = pool_descriptor(kv_transfer_info);
            new (self) PyPool{
                std::make_shared<KVCachePool>(
                    nb::cast<const PyKVCache&>(cache).cache, descriptor, scatter_seed,
                    std::chrono::milliseconds(static_cast<std::int64_t>(lease_s * 1000 + 0.5))),
                nb::borrow(cache)};
          },
          nb::arg("kv_cache"), nb::arg("kv_transfer_info").none() = nb::none(),
          nb::arg("scatter_seed") = 0, nb::arg("lease") = 60.0)
      .def_prop_ro("kv_cache", [](const PyPool& p) { return p.cache; })
      .def(
          "allocate",
          [](PyPool& p, std::uint64_t seq_id, std::uint64_t num_tokens) {
            return p.pool->allocate(seq_id, num_tokens);
          },
          nb::arg("seq_id"), nb::arg("num_tokens"),
          "Pages for a new sequence: ceil(num_tokens / page_size) of them.")
      .def(
          "adopt",
          [](PyPool& p, std::uint64_t seq_id, std::uint64_t num_tokens, nb::handle pages,
             bool allow_shared, std::uint64_t epoch) {
            const auto v = to_pages(pages, "pages");
            p.pool->adopt(seq_id, num_tokens, v, allow_shared, epoch);
          },
          nb::arg("seq_id"), nb::arg("num_tokens"), nb::arg("pages"),
          nb::arg("allow_shared") = false, nb::arg("epoch") = 0,
          "A new sequence over pages the caller chose (an engine that allocates its own "
          "blocks, e.g. vLLM publishing a finished request's blocks): exactly "
          "ceil(num_tokens / page_size) pages, each in range and named once; its free pages "
          "are stamped with a fresh epoch as allocate() does. allow_shared=True (prefix "
          "caching): a page another live sequence holds is shared, keeping its epoch and "
          "bytes (publish lists it in kv_transfer_info.page_epochs); it is freed when its "
          "last holder is. Raises InvalidArgumentError naming the page or the counts, "
          "changing nothing, for a page out of range, named twice, held by allocate_pages, "
          "or (without allow_shared) held by a live sequence. epoch (0: the pool picks) "
          "names the sequence's epoch in advance; it must not be below any epoch this pool "
          "stamped before.")
      .def(
          "holders", [](PyPool& p, std::uint32_t page) { return p.pool->holders(page); },
          nb::arg("page"), "How many live sequences hold the page (0: free or allocate_pages').")
      .def(
          "free", [](PyPool& p, std::uint64_t seq_id) { p.pool->release(seq_id); },
          nb::arg("seq_id"), "Frees every page of the sequence.")
      .def(
          "done",
          [](PyPool& p, std::uint64_t seq_id, std::uint64_t epoch) {
            nb::gil_scoped_release release;
            return p.pool->done(seq_id, epoch);
          },
          nb::arg("seq_id"), nb::arg("epoch") = 0,
          "A reader's done notice: frees the sequence if it is still the one published with "
          "`epoch` (0: whichever holds seq_id). False when it was freed already or seq_id "
          "names a newer request.")
      .def(
          "expire_leases", [](PyPool& p) { return p.pool->expire_leases(); },
          "Frees every published sequence whose lease expired; returns how many.")
      .def("expired_count", [](const PyPool& p) { return p.pool->expired_count(); })
      .def_prop_ro(
          "lease", [](const PyPool& p) { return p.pool->lease().count() / 1000.0; },
          "Seconds a published sequence stays readable without a done notice.")
      .def(
          "pages", [](const PyPool& p, std::uint64_t seq_id) { return p.pool->pages(seq_id); },
          nb::arg("seq_id"))
      .def(
          "__contains__",
          [](const PyPool& p, std::uint64_t seq_id) { return p.pool->contains(seq_id); },
          nb::arg("seq_id"))
      .def("free_page_count", [](const PyPool& p) { return p.pool->free_page_count(); })
      .def(
          "publish",
          [](PyPool& p, std::uint64_t seq_id, std::optional<std::uint32_t> layers_ready) {
            return layers_ready ? p.pool->publish(seq_id, *layers_ready) : p.pool->publish(seq_id);
          },
          nb::arg("seq_id"), nb::arg("layers_ready").none() = nb::none(),
          "The SequenceInfo another process needs to pull this sequence. Without "
          "`layers_ready` the sequence is declared written (every layer ready). With it "
          "(usually 0) it is published before its layers are written, for readers that stream "
          "(start_streaming_retrieve); mark each layer with mark_layers_ready as the forward "
          "pass writes it.")
      .def(
          "mark_layers_ready",
          [](PyPool& p, std::uint64_t seq_id, std::uint32_t layers_done) {
            p.pool->mark_layers_ready(seq_id, layers_done);
          },
          nb::arg("seq_id"), nb::arg("layers_done"),
          "Layers [0, layers_done) of the sequence hold their final bytes (vLLM's "
          "save_kv_layer). Cheap: a lock and one store per page, no syscall. Monotonic: the "
          "same value again is a no-op; a smaller one or one beyond the layout's layers raises "
          "InvalidArgumentError naming both; an unknown sequence NotFoundError.")
      .def(
          "mark_layers_ready_after",
          [](PyPool& p, std::uint64_t seq_id, std::uint32_t layers_done, nb::handle stream) {
#if MSTAR_KV_PY_HAVE_CUDA_IPC
            std::uintptr_t handle = 0;
            if (!stream.is_none()) {
              nb::handle h =
                  nb::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream") : stream;
              handle = nb::cast<std::uintptr_t>(h);
            }
            mark_layers_ready_after(p.pool, seq_id, layers_done, reinterpret_cast<void*>(handle));
#else
            (void)p, (void)seq_id, (void)layers_done, (void)stream;
            throw Error(StatusCode::kUnavailable,
                        "mark_layers_ready_after needs the cuda_ipc engine, which is not built "
                        "into this mstar_kv");
#endif
          },
          nb::arg("seq_id"), nb::arg("layers_done"), nb::arg("stream").none() = nb::none(),
          "mark_layers_ready, enqueued on a CUDA stream (a device cache over the cuda_ipc "
          "engine): the mark lands once the kernels enqueued on `stream` before it have "
          "completed, so readers never copy a layer still being written, and the forward pass "
          "never waits. `stream` is a torch.cuda.Stream (anything with cuda_stream), a raw "
          "cudaStream_t as an int, or None for the legacy default stream. Returns at once; a "
          "mark the pool refuses by then (sequence freed, going backwards) is logged and "
          "dropped. Raises UnavailableError without the cuda_ipc engine.")
      .def(
          "layers_ready",
          [](const PyPool& p, std::uint64_t seq_id) { return p.pool->layers_ready(seq_id); },
          nb::arg("seq_id"), "What mark_layers_ready (or publish) last stamped.");
}

}  // namespace mstar::kv::py
