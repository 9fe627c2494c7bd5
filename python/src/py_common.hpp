// Copyright mstar-kv authors.
//
// Shared by the nanobind bindings of mstar_kv._core (python/src/*.cpp).
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/streaming.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::py {

namespace nb = nanobind;

void bind_errors(nb::module_& m);
void bind_layout(nb::module_& m);
void bind_cache(nb::module_& m);
void bind_descriptors(nb::module_& m);
void bind_engines(nb::module_& m);
void bind_mooncake(nb::module_& m);
void bind_manager(nb::module_& m);
void bind_pool(nb::module_& m);
void bind_requests(nb::module_& m);

// The Python-side holder of a cache. The shared_ptr's deleter releases any
// Python object the memory came from (under the GIL), so an engine that
// outlives the Python object still writes into live memory.
struct PyKVCache {
  std::shared_ptr<KVCache> cache;
  int device = 0;  // CUDA ordinal of device memory
};

// The Python-side holder of a pool (mstar_kv.KVCachePool) and the Python
// KVCache it was made over.
struct PyPool {
  std::shared_ptr<KVCachePool> pool;
  nb::object cache;
};

// The Python-side holder of a native engine (mstar_kv._core._Engine).
struct PyEngine {
  std::shared_ptr<KVTransferEngine> engine;
  std::shared_ptr<KVCache> cache;  // null for the local-only engine
  std::chrono::milliseconds timeout{30000};
};

// Seconds from Python as milliseconds: (0, 86400] ([0, ...] with zero_ok),
// else Error(kInvalidArgument) naming `name`, the value and the range. The
// one parser of the bindings' durations.
std::chrono::milliseconds seconds_option(const char* name, double seconds, bool zero_ok = false);

// Read infos from a Python sequence of KVReadInfo; Error(kInvalidArgument)
// naming the entry that is not one.
std::vector<KVReadInfo> to_reads(nb::handle seq);

// StreamOptions from the Python arguments (seconds); throws
// Error(kInvalidArgument) naming both when out of range.
StreamOptions stream_options(double ready_timeout_s, double poll_interval_s,
                             std::uint32_t max_reads_in_flight);

// Page tables from Python: any sequence of ints (list, tuple, range, numpy).
// Throws Error(kInvalidArgument) naming `what` and the entry outside
// [0, 2^32).
std::vector<std::uint32_t> to_pages(nb::handle seq, const char* what);

// A KVTransferInfo from what Python callers hold: a KVTransferInfo, an
// engine's typed info (anything with .encode() -> KVTransferInfo), or the
// bytes of KVTransferInfo.to_bytes(). Throws Error(kInvalidArgument) for
// anything else, naming its type.
KVTransferInfo to_transfer_info(nb::handle obj);

// A Python callable that a future runs when it resolves. Resolution happens
// on an engine thread, which must never wait for the GIL (it would stall the
// engine's copies behind whatever Python runs): call_resolved() only queues
// the call for one dispatcher thread per process, which takes the GIL, calls
// fn(code, message, bytes) once and drops the reference. Nothing runs once
// the interpreter finalises (mstar_kv stops the dispatcher at exit).
class PyCallback {
 public:
  explicit PyCallback(nb::handle fn);
  ~PyCallback();
  PyCallback(const PyCallback&) = delete;
  PyCallback& operator=(const PyCallback&) = delete;
  // Safe from any thread; never blocks on the GIL.
  void call_resolved(const Status& status, std::uint64_t bytes);

 private:
  friend class Dispatcher;
  PyObject* fn_;  // owned reference; released by the dispatcher
};

// Joins the dispatcher (pending calls are dropped). Called at Python exit.
void stop_dispatcher();
void bind_callbacks(nb::module_& m);

// True while Python code may still run (not finalising).
bool python_alive() noexcept;

}  // namespace mstar::kv::py
