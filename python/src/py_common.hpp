// Copyright mstar-kv authors.
//
// Shared by the nanobind bindings of mstar_kv._core (python/src/*.cpp).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv::py {

namespace nb = nanobind;

void bind_errors(nb::module_& m);
void bind_layout(nb::module_& m);
void bind_cache(nb::module_& m);
void bind_descriptors(nb::module_& m);
void bind_engines(nb::module_& m);
void bind_mooncake(nb::module_& m);

// The Python-side holder of a cache. The shared_ptr's deleter releases any
// Python object the memory came from (under the GIL), so an engine that
// outlives the Python object still writes into live memory.
struct PyKVCache {
  std::shared_ptr<KVCache> cache;
  int device = 0;  // CUDA ordinal of device memory
};

// Page tables from Python: any sequence of ints (list, tuple, range, numpy).
// Throws Error(kInvalidArgument) naming `what` and the entry outside
// [0, 2^32).
std::vector<std::uint32_t> to_pages(nb::handle seq, const char* what);

// A KVTransferInfo from what Python callers hold: a KVTransferInfo, an
// engine's typed info (anything with .encode() -> KVTransferInfo), or the
// bytes of KVTransferInfo.to_bytes(). Throws Error(kInvalidArgument) for
// anything else, naming its type.
KVTransferInfo to_transfer_info(nb::handle obj);

// Runs a Python callable later from any thread: holds a strong reference and
// drops it under the GIL. Calls are skipped once the interpreter finalises.
class PyCallback {
 public:
  explicit PyCallback(nb::handle fn);
  ~PyCallback();
  PyCallback(const PyCallback&) = delete;
  PyCallback& operator=(const PyCallback&) = delete;
  void call_resolved(const Status& status, std::uint64_t bytes);

 private:
  PyObject* fn_;
};

// True while Python code may still run (not finalising).
bool python_alive() noexcept;

}  // namespace mstar::kv::py
