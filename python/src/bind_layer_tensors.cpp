// Copyright mstar-kv authors.
//
// KVCache.from_layer_tensors: a cache of one region per layer over the
// caller's per-layer tensors (vLLM's register_kv_caches), each checked and
// wrapped without a copy.
#include <nanobind/ndarray.h>
// Every TU that casts std::string must see its caster (else an ODR clash
// with the TUs that do: nb::cast<std::string> throws std::bad_cast).
#include <nanobind/stl/string.h>

#include <memory>
#include <string>
#include <vector>

#include "cache_tensors.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

namespace {

namespace dl = nb::dlpack;

// One layer's tensor of a cache of one region per layer: the layout's view
// without its layer axis (layer-major [num_kv, num_pages, P0, P1,
// head_dim]: vLLM's per-layer [2, num_blocks, block_size, num_kv_heads,
// head_size]), or flat; every layout's dtype rule and C-contiguous. Named
// by the layer and the expected shape.
std::size_t check_layer_tensor(const nb::ndarray<>& a, const KVLayout& layout, std::size_t layer) {
  const std::string who = "layer " + std::to_string(layer) + " tensor";
  const dl::dtype want = layout_dtype(layout.dtype);
  const dl::dtype got = a.dtype();
  const std::size_t es = layout.element_size();
  const bool same_size_int = (got.code == static_cast<std::uint8_t>(dl::dtype_code::UInt) ||
                              got.code == static_cast<std::uint8_t>(dl::dtype_code::Int)) &&
                             got.bits == es * 8 && got.lanes == 1;
  if (!(got == want) && !same_size_int && !(got == uint_dtype(1))) {
    throw Error(StatusCode::kInvalidArgument,
                who + " dtype " + dtype_name(got) + " does not match the layout's dtype " +
                    std::string(to_string(layout.dtype)) + " (accepted: " + dtype_name(want) +
                    ", an integer type of " + std::to_string(es) + " bytes, or uint8)");
  }
  std::vector<std::size_t> shape(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = a.shape(i);
  std::vector<std::size_t> view = view_shape(layout);
  std::vector<std::size_t> want_shape(view.begin() + 1, view.end());  // no layer axis
  const std::size_t item = got.bits / 8;
  if (item != es) want_shape.back() *= es / item;
  const std::uint64_t items = layout.layer_bytes() / item;
  const bool flat = shape.size() == 1 && shape[0] == items;
  if (!flat && shape != want_shape) {
    throw Error(StatusCode::kInvalidArgument,
                who + " shape " + shape_str(shape) + " does not match one layer of the layout " +
                    layout.to_string() + ": expected " + shape_str(want_shape) + " or flat [" +
                    std::to_string(items) + "] (" + std::to_string(layout.layer_bytes()) +
                    " bytes)");
  }
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) {
      throw Error(StatusCode::kInvalidArgument,
                  who + " stride " + std::to_string(a.stride(i)) + " (elements) at dim " +
                      std::to_string(i) + " is not C-contiguous (expected " +
                      std::to_string(expect) + "): pass tensor.contiguous()");
    }
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
  return layout.layer_bytes();
}

}  // namespace

// KVCache.from_layer_tensors: one region per layer, each the caller's
// tensor, no copy (the cache's regions are the tensors' data pointers).
PyKVCache from_layer_tensors(nb::handle tensors, const KVLayout& layout) {
  layout.validate();
  if (!layout.layer_contiguous()) {
    throw Error(StatusCode::kInvalidArgument,
                "from_layer_tensors needs a layout whose layers are contiguous (layer-major or "
                "layer-page), got " +
                    std::string(to_string(layout.cache_order)) +
                    "-major: its layers interleave page by page (use from_dlpack with one tensor)");
  }
  if (!nb::isinstance<nb::sequence>(tensors) || nb::isinstance<nb::str>(tensors)) {
    throw Error(StatusCode::kInvalidArgument,
                "from_layer_tensors takes a list of per-layer tensors, got " +
                    nb::cast<std::string>(nb::str(tensors.type().attr("__name__"))));
  }
  const std::size_t n = nb::len(tensors);
  if (n != layout.num_layers) {
    throw Error(StatusCode::kInvalidArgument, "from_layer_tensors got " + std::to_string(n) +
                                                  " tensors for the layout's " +
                                                  std::to_string(layout.num_layers) + " layers");
  }
  std::vector<nb::ndarray<>> arrays;
  arrays.reserve(n);
  int dev = -1;
  int dev_id = 0;
  for (std::size_t l = 0; l < n; ++l) {
    nb::object obj = tensors[l];  // owns the item (an accessor is a temporary)
    nb::ndarray<> a;
    if (!nb::try_cast(obj, a)) {
      const std::string type = nb::cast<std::string>(nb::str(obj.type().attr("__name__")));
      nb::ndarray<nb::ro> ro;
      throw Error(StatusCode::kInvalidArgument,
                  "layer " + std::to_string(l) + " tensor of type " + type +
                      (nb::try_cast(obj, ro) ? " is read-only: pulls write into the cache"
                                             : " is not a tensor (no __dlpack__, no buffer "
                                               "protocol)"));
    }
    const int d =
        a.device_type() == nb::device::cuda_host::value ? nb::device::cpu::value : a.device_type();
    if (d != nb::device::cpu::value && d != nb::device::cuda::value) {
      throw Error(StatusCode::kInvalidArgument,
                  "layer " + std::to_string(l) + " tensor on DLPack device type " +
                      std::to_string(a.device_type()) + " is neither host nor CUDA memory");
    }
    const int id = d == nb::device::cuda::value ? static_cast<int>(a.device_id()) : 0;
    if (l == 0) {
      dev = d;
      dev_id = id;
    } else if (d != dev || id != dev_id) {
      throw Error(StatusCode::kInvalidArgument,
                  "layer " + std::to_string(l) + " tensor is on " +
                      (d == nb::device::cpu::value ? std::string("the host")
                                                   : "CUDA device " + std::to_string(id)) +
                      ", layer 0's on " +
                      (dev == nb::device::cpu::value ? std::string("the host")
                                                     : "CUDA device " + std::to_string(dev_id)) +
                      ": every layer must live on one device");
    }
    check_layer_tensor(a, layout, l);
    arrays.push_back(a);
  }
  std::vector<std::unique_ptr<KVMemory>> memories;
  memories.reserve(n);
  for (nb::ndarray<>& a : arrays) {
    auto* data = static_cast<std::byte*>(a.data());
    if (dev == nb::device::cpu::value) {
      memories.push_back(std::make_unique<ForeignHostMemory>(data, layout.layer_bytes()));
    } else {
#if MSTAR_KV_PY_HAVE_CUDA_IPC
      memories.push_back(wrap_device_memory(data, layout.layer_bytes(), a.device_id()));
#else
      throw Error(StatusCode::kUnavailable,
                  "CUDA tensors need the cuda_ipc engine, which is not built into this mstar_kv");
#endif
    }
  }
  return cache_over_arrays(layout, std::move(memories), std::move(arrays),
                           dev == nb::device::cuda::value ? dev_id : 0);
}

}  // namespace mstar::kv::py
