// Copyright mstar-kv authors.
//
// Layer-wise streaming over an engine written in Python (the Mooncake wheel
// engine, mstar_kv.mooncake_wheel): the engine is wrapped as a C++
// KVTransferEngine so that the one C++ stream driver (streaming.hpp) drives
// it exactly as it drives the native engines: same planning, in-order
// issuing, timeouts, cancel and in-flight limits.
//
// The driver thread takes the GIL only to call the Python engine: once per
// group of ready layers (read_batched_async) and, at most every
// kPythonPollInterval, the engine's watch (which itself bounds how often it
// asks the owner); it never holds a C++ lock meanwhile, and every binding
// below releases the GIL before it waits on the driver. A Python future
// resolves the C++ one from its done-callback; cancelling the C++ future
// cancels the Python one. Nothing touches Python once it finalises.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "mstar/kv/engine.hpp"
#include "mstar/kv/future.hpp"
#include "mstar/kv/streaming.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPythonPollInterval = std::chrono::microseconds(200);

// A Python reference that C++ threads may copy and drop: the last owner
// takes the GIL to release it (or leaks it once Python finalises).
struct PyRef {
  nb::object obj;
  explicit PyRef(nb::object o) : obj(std::move(o)) {}
  ~PyRef() {
    if (!python_alive()) {
      obj.release();  // the interpreter is gone: nothing to decref into
      return;
    }
    nb::gil_scoped_acquire gil;
    obj.reset();
  }
};

// The Status a Python exception stands for (GIL held): a KVTransferError's
// code and message, else kInternal naming the type.
Status status_of(nb::handle exc) {
  std::string msg = nb::cast<std::string>(nb::str(exc));
  if (nb::hasattr(exc, "code")) {
    try {
      return {static_cast<StatusCode>(nb::cast<int>(exc.attr("code"))), std::move(msg)};
    } catch (const std::exception&) {
    }
  }
  return {StatusCode::kInternal,
          nb::cast<std::string>(nb::str(exc.type().attr("__name__"))) + ": " + msg};
}

// Calls fn() with the GIL; a Python exception becomes Error(its Status).
template <typename Fn>
auto call_python(Fn&& fn) {
  if (!python_alive()) throw Error(StatusCode::kShutdown, "Python is finalising");
  nb::gil_scoped_acquire gil;
  try {
    return fn();
  } catch (nb::python_error& e) {
    throw Error(status_of(e.value()));
  }
}

nb::list reads_list(std::span<const KVReadInfo> reads) {
  nb::list l;
  for (const KVReadInfo& r : reads) l.append(nb::cast(r));
  return l;
}

class PyLayerWatch final : public LayerWatch {
 public:
  explicit PyLayerWatch(std::shared_ptr<PyRef> watch) : watch_(std::move(watch)) {}
  ~PyLayerWatch() override {
    try {
      call_python([&] {
        if (nb::hasattr(watch_->obj, "close")) watch_->obj.attr("close")();
        return 0;
      });
    } catch (const Error&) {
    }
  }

  Status poll(std::uint32_t* layers_ready) override {
    const auto now = Clock::now();
    if (now >= next_) {
      next_ = now + kPythonPollInterval;
      try {
        last_ = call_python([&] { return nb::cast<std::uint32_t>(watch_->obj.attr("poll")()); });
      } catch (const Error& e) {
        return e.status();
      }
    }
    *layers_ready = last_;
    return Status::ok();
  }

 private:
  std::shared_ptr<PyRef> watch_;
  std::uint32_t last_ = 0;
  Clock::time_point next_{};
};

// A Python engine seen from C++. Its lifetime (shutdown) stays the Python
// manager's.
class PyEngineBridge final : public KVTransferEngine {
 public:
  explicit PyEngineBridge(nb::object engine)
      : engine_(std::make_shared<PyRef>(std::move(engine))) {}

  KVTransferInfo get_kv_transfer_info() const override {
    return call_python([&] { return to_transfer_info(engine_->obj.attr("get_kv_transfer_info")()); });
  }

  std::optional<KVLayout> remote_layout(const KVTransferInfo& remote) const override {
    return call_python([&]() -> std::optional<KVLayout> {
      if (!nb::hasattr(engine_->obj, "remote_layout")) return std::nullopt;
      nb::object l = engine_->obj.attr("remote_layout")(nb::cast(remote));
      if (l.is_none()) return std::nullopt;
      return nb::cast<KVLayout>(l);
    });
  }

  std::optional<TransferFuture> read_batched_async(
      const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> read_info) override {
    TransferPromise promise;
    std::shared_ptr<PyRef> py_future = call_python([&]() -> std::shared_ptr<PyRef> {
      nb::object f = engine_->obj.attr("read_batched_async")(nb::cast(remote_kv_info),
                                                            reads_list(read_info));
      if (f.is_none()) return nullptr;
      f.attr("add_done_callback")(nb::cpp_function([promise](nb::handle done) {
        TransferPromise p = promise;  // copies share the one state
        if (nb::cast<bool>(done.attr("cancelled")())) {
          p.fail({StatusCode::kCancelled, "the Python engine's read was cancelled"});
          return;
        }
        nb::object exc = done.attr("exception")();
        if (!exc.is_none()) {
          p.fail(status_of(exc));
          return;
        }
        p.complete(nb::cast<std::uint64_t>(done.attr("result")()));
      }));
      return std::make_shared<PyRef>(std::move(f));
    });
    if (!py_future) return std::nullopt;
    promise.on_cancel([py_future] {
      try {
        call_python([&] { return py_future->obj.attr("cancel")(); });
      } catch (const Error&) {
      }
    });
    return promise.future();
  }

  std::unique_ptr<LayerWatch> watch_layers(const KVTransferInfo& remote_kv_info,
                                           std::span<const KVReadInfo> read_info) override {
    auto watch = call_python([&]() -> std::shared_ptr<PyRef> {
      if (!nb::hasattr(engine_->obj, "watch_layers")) return nullptr;
      return std::make_shared<PyRef>(
          engine_->obj.attr("watch_layers")(nb::cast(remote_kv_info), reads_list(read_info)));
    });
    if (!watch) return KVTransferEngine::watch_layers(remote_kv_info, read_info);  // kUnavailable
    return std::make_unique<PyLayerWatch>(std::move(watch));
  }

  void shutdown() override {}

 private:
  std::shared_ptr<PyRef> engine_;
};

// The driver over one Python engine (mstar_kv.KVTransferManager keeps one).
struct PyStreamer {
  std::unique_ptr<PyEngineBridge> bridge;
  std::unique_ptr<LayerStreamer> streamer;

  ~PyStreamer() {
    nb::gil_scoped_release release;  // the driver may be waiting for the GIL
    streamer.reset();
  }
};

}  // namespace

void bind_py_streaming(nb::module_& m) {
  nb::class_<PyStreamer>(m, "_PyEngineStreamer",
                         "The C++ stream driver over a Python engine with watch_layers.")
      .def(
          "__init__",
          [](PyStreamer* self, nb::object engine, const PyKVCache& cache, double timeout_s) {
            new (self) PyStreamer();
            self->bridge = std::make_unique<PyEngineBridge>(std::move(engine));
            self->streamer = std::make_unique<LayerStreamer>(
                *self->bridge, cache.cache,
                std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000 + 0.5)));
          },
          nb::arg("engine"), nb::arg("kv_cache"), nb::arg("timeout"))
      .def(
          "start",
          [](PyStreamer& s, std::uint64_t start_len, std::uint64_t end_len, nb::handle local_pages,
             nb::handle remote_pages, nb::handle remote, double ready_timeout_s,
             double poll_interval_s, std::uint32_t max_reads_in_flight) -> std::optional<LayerStream> {
            const auto lp = to_pages(local_pages, "local_page_indices");
            const auto rp = to_pages(remote_pages, "remote_page_indices");
            const KVTransferInfo info = to_transfer_info(remote);
            const StreamOptions o =
                stream_options(ready_timeout_s, poll_interval_s, max_reads_in_flight);
            nb::gil_scoped_release release;
            return s.streamer->start(start_len, end_len, lp, rp, info, o);
          },
          nb::arg("start_len"), nb::arg("end_len"), nb::arg("local_page_indices"),
          nb::arg("remote_page_indices"), nb::arg("kv_transfer_info").none(),
          nb::arg("ready_timeout") = 0.0, nb::arg("poll_interval") = 20e-6,
          nb::arg("max_reads_in_flight") = 4)
      .def("stop", [](PyStreamer& s) {
        nb::gil_scoped_release release;
        s.streamer->stop();
      });
}

}  // namespace mstar::kv::py
