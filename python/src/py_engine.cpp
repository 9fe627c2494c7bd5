// Copyright mstar-kv authors.
//
// PyEngineBridge (py_engine.hpp): a Python engine as a C++ KVTransferEngine.
#include "py_engine.hpp"

#include <nanobind/stl/string.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "mstar/kv/core/future.hpp"

namespace mstar::kv::py {

namespace {

using Clock = std::chrono::steady_clock;
// How often the stream driver may call a Python watch's poll() (it asks the
// owner at most as often as its own engine allows).
constexpr auto kPythonPollInterval = std::chrono::microseconds(200);

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

std::string py_type_name(nb::handle obj) {
  return nb::cast<std::string>(nb::str(obj.type().attr("__name__")));
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

}  // namespace

PyRef::~PyRef() {
  if (!python_alive()) {
    obj.release();  // the interpreter is gone: nothing to decref into
    return;
  }
  nb::gil_scoped_acquire gil;
  obj.reset();
}

Status status_of(nb::handle exc) {
  std::string msg = nb::cast<std::string>(nb::str(exc));
  if (nb::hasattr(exc, "code")) {
    try {
      return {static_cast<StatusCode>(nb::cast<int>(exc.attr("code"))), std::move(msg)};
    } catch (const std::exception&) {
    }
  }
  return {StatusCode::kInternal, py_type_name(exc) + ": " + msg};
}

PyEngineBridge::PyEngineBridge(nb::object engine)
    : engine_(std::make_shared<PyRef>(std::move(engine))), name_(py_type_name(engine_->obj)) {}

KVTransferInfo PyEngineBridge::get_kv_transfer_info() const {
  return call_python([&] {
    nb::object info = engine_->obj.attr("get_kv_transfer_info")();
    if (info.is_none()) return KVTransferInfo{};
    try {
      return to_transfer_info(info);
    } catch (const Error&) {
      return KVTransferInfo{name_, {}, 0};  // a descriptor of the engine's own type
    }
  });
}

RemoteHandle PyEngineBridge::open_remote(const KVTransferInfo& remote) const {
  return call_python([&] { return open_py(nb::cast(remote)); });
}

RemoteHandle PyEngineBridge::open_py(nb::handle remote) const {
  std::optional<KVLayout> layout;
  if (nb::hasattr(engine_->obj, "remote_layout")) {
    try {
      nb::object l = engine_->obj.attr("remote_layout")(remote);
      if (!l.is_none()) layout = nb::cast<KVLayout>(l);
    } catch (nb::python_error& e) {
      throw Error(status_of(e.value()));
    }
  }
  KVTransferInfo info;
  if (nb::isinstance<KVTransferInfo>(remote)) {
    info = nb::cast<KVTransferInfo>(remote);
  } else {
    info.engine = name_;  // the engine's own descriptor type: named for messages
    if (nb::hasattr(remote, "epoch")) {
      std::uint64_t e = 0;
      if (nb::try_cast<std::uint64_t>(remote.attr("epoch"), e)) info.epoch = e;
    }
  }
  return std::make_shared<PyRemote>(std::move(info), std::move(layout),
                                    std::make_shared<PyRef>(nb::borrow(remote)));
}

std::optional<TransferFuture> PyEngineBridge::read_batched_async(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  const auto* py_remote = dynamic_cast<const PyRemote*>(&remote);
  if (py_remote == nullptr) throw_foreign_remote(remote, name_.c_str());
  TransferPromise promise;
  std::shared_ptr<PyRef> py_future = call_python([&]() -> std::shared_ptr<PyRef> {
    nb::object f =
        engine_->obj.attr("read_batched_async")(py_remote->object()->obj, reads_list(read_info));
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

std::unique_ptr<LayerWatch> PyEngineBridge::watch_layers(const RemoteCache& remote,
                                                         std::span<const KVReadInfo> read_info) {
  const auto* py_remote = dynamic_cast<const PyRemote*>(&remote);
  if (py_remote == nullptr) throw_foreign_remote(remote, name_.c_str());
  auto watch = call_python([&]() -> std::shared_ptr<PyRef> {
    if (!nb::hasattr(engine_->obj, "watch_layers")) return nullptr;
    return std::make_shared<PyRef>(
        engine_->obj.attr("watch_layers")(py_remote->object()->obj, reads_list(read_info)));
  });
  if (!watch) {
    throw Error(StatusCode::kNotSupported,
                "layer-wise streaming over " + name_ +
                    ": it has no readiness channel (watch_layers); shm, ucx, cuda_ipc and the "
                    "Mooncake engines stream");
  }
  return std::make_unique<PyLayerWatch>(std::move(watch));
}

void PyEngineBridge::notify_done(const RemoteCache& remote, std::uint64_t seq_id) {
  const auto* py_remote = dynamic_cast<const PyRemote*>(&remote);
  if (py_remote == nullptr) throw_foreign_remote(remote, name_.c_str());
  const bool sent = call_python([&] {
    if (!nb::hasattr(engine_->obj, "notify_done")) return false;
    engine_->obj.attr("notify_done")(py_remote->object()->obj, seq_id);
    return true;
  });
  if (!sent) {
    throw Error(StatusCode::kNotSupported,
                "the " + name_ +
                    " engine has no channel back to the owner for the done notice "
                    "of sequence " +
                    std::to_string(seq_id) +
                    ": send it over the side channel that carried the SequenceInfo (the owner "
                    "calls KVCachePool.done)");
  }
}

void PyEngineBridge::shutdown() {
  if (!python_alive()) return;
  try {
    call_python([&] { return engine_->obj.attr("shutdown")(); });
  } catch (const Error& e) {
    if (e.code() != StatusCode::kShutdown) throw;
  }
}

}  // namespace mstar::kv::py
