// Copyright mstar-kv authors.
//
// What the KVCache bindings share between bind_cache.cpp (caches the library
// allocates, from_dlpack, the tensor view) and bind_layer_tensors.cpp
// (from_layer_tensors): the caller's host memory, the layout's DLPack dtype
// and view shape, and the messages' spellings of them.
#pragma once

#include <nanobind/ndarray.h>
// Every TU that casts std::string must see its caster (else an ODR clash
// with the TUs that do: nb::cast<std::string> throws std::bad_cast).
#include <nanobind/stl/string.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

// Host memory owned by someone else (a numpy array, a torch CPU tensor).
class ForeignHostMemory final : public KVMemory {
 public:
  ForeignHostMemory(std::byte* data, std::size_t size) : data_(data), size_(size) {}
  std::byte* data() const noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kHost; }

 private:
  std::byte* data_;
  std::size_t size_;
};

// The DLPack dtype of the layout's elements; an unsigned integer of `bytes`.
nb::dlpack::dtype layout_dtype(DType d);
nb::dlpack::dtype uint_dtype(std::size_t bytes);
// "bfloat16", "uint8", "float8_e4m3fn", ... for messages.
std::string dtype_name(nb::dlpack::dtype d);
// The tensor view of a cache (bind_cache.cpp): layer-major [num_layers,
// num_kv, num_pages, P0, P1, head_dim], page-major [num_pages, num_layers,
// num_kv, P0, P1, head_dim].
std::vector<std::size_t> view_shape(const KVLayout& l);
// "[2, 64, 16]".
std::string shape_str(const std::vector<std::size_t>& s);

// A cache over the caller's tensors: `memory` is their bytes, `arrays` the
// references that keep them alive. When the cache's last owner lets go, the
// references are dropped under the GIL, from whatever thread that is; while
// Python finalises, nothing is touched and they leak.
template <typename Memory, typename Arrays>
PyKVCache cache_over_arrays(const KVLayout& layout, Memory memory, Arrays arrays, int device) {
  auto* keep = new Arrays(std::move(arrays));
  KVCache* raw = nullptr;
  try {
    raw = new KVCache(layout, std::move(memory));  // its checks name overlaps and kinds
  } catch (...) {
    delete keep;
    throw;
  }
  return PyKVCache{std::shared_ptr<KVCache>(raw,
                                            [keep](KVCache* c) {
                                              delete c;
                                              if (!python_alive()) return;
                                              nb::gil_scoped_acquire gil;
                                              delete keep;
                                            }),
                   device};
}

// KVCache.from_layer_tensors (bind_layer_tensors.cpp).
PyKVCache from_layer_tensors(nb::handle tensors, const KVLayout& layout);

}  // namespace mstar::kv::py
