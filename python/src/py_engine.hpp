// Copyright mstar-kv authors.
//
// A Python engine seen from C++: PyEngineBridge wraps any object with the
// spec's KVTransferEngine methods (a user's subclass, the Mooncake wheel
// engine) into a C++ KVTransferEngine, so that the one C++
// KVTransferManager plans, streams, counts and shuts it down exactly as it
// does the native engines.
//
// Threads and the GIL: every call into Python takes the GIL (call_python),
// and no C++ lock is held meanwhile; a Python future resolves the C++ one
// from its done-callback; cancelling the C++ future cancels the Python one.
// Nothing touches Python once the interpreter finalises (calls then fail
// with kShutdown). References to Python objects that C++ threads copy are
// PyRefs: the last owner takes the GIL to drop it.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>

#include "mstar/kv/core/engine.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

// A Python reference that C++ threads may copy and drop.
struct PyRef {
  nb::object obj;
  explicit PyRef(nb::object o) : obj(std::move(o)) {}
  ~PyRef();
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
};

// A descriptor a Python engine opened: the caller's object as given (any
// Python object: the spec types descriptors as Any).
class PyRemote final : public RemoteCache {
 public:
  PyRemote(KVTransferInfo info, std::optional<KVLayout> layout, std::shared_ptr<PyRef> obj)
      : RemoteCache(std::move(info), std::move(layout)), obj_(std::move(obj)) {}
  const std::shared_ptr<PyRef>& object() const noexcept { return obj_; }

 private:
  std::shared_ptr<PyRef> obj_;
};

class PyEngineBridge final : public KVTransferEngine {
 public:
  // GIL held.
  explicit PyEngineBridge(nb::object engine);

  using KVTransferEngine::read_batched_async;
  // The engine's Python class name (stats, messages).
  std::string name() const override { return name_; }
  // Python's get_kv_transfer_info() as a KVTransferInfo where it is one (or
  // encodes to one); else {engine = name()} (a Python engine's own
  // descriptor type stays Python's: see KVTransferManager's binding).
  KVTransferInfo get_kv_transfer_info() const override;
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  // The caller's Python object, with the layout the engine's optional
  // remote_layout(obj) tells (validating it). GIL held.
  RemoteHandle open_py(nb::handle remote) const;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;
  void notify_done(const RemoteCache& remote, std::uint64_t seq_id) override;
  // Calls the Python engine's shutdown() (once Python is gone, nothing).
  void shutdown() override;

  const nb::object& object() const noexcept { return engine_->obj; }

 private:
  std::shared_ptr<PyRef> engine_;
  std::string name_;
};

// The Status a Python exception stands for (GIL held): a KVTransferError's
// code and message, else kInternal naming the type.
Status status_of(nb::handle exc);

}  // namespace mstar::kv::py
