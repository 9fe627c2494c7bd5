// Copyright mstar-kv authors.
//
// KVCache: caches the library allocates (visible to numpy / torch through
// DLPack and __array_interface__ without a copy) and caches over the
// caller's memory (any __dlpack__ object: numpy, torch CPU and CUDA tensors).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <string>
#include <vector>

#include "cache_tensors.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "mstar/kv/util/enum_names.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

namespace dl = nb::dlpack;

namespace {

constexpr std::array<std::string_view, 3> kMemoryNames{"host", "shared", "device"};
static_assert(kMemoryNames.size() == static_cast<std::size_t>(MemoryKind::kDevice) + 1);

std::string memory_name(MemoryKind k) { return std::string(enum_name(k, kMemoryNames, "?")); }

MemoryKind parse_memory(const std::string& s) {
  if (auto k = enum_from_name<MemoryKind>(s, kMemoryNames)) return *k;
  throw Error(StatusCode::kInvalidArgument,
              "memory '" + s + "' is not one of 'host', 'shared', 'device'");
}

}  // namespace

// Shared with bind_layer_tensors.cpp (cache_tensors.hpp).
dl::dtype layout_dtype(DType d) {
  switch (d) {
    case DType::kFloat32:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float), 32, 1};
    case DType::kFloat16:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float), 16, 1};
    case DType::kBFloat16:
      return {static_cast<std::uint8_t>(dl::dtype_code::Bfloat), 16, 1};
    case DType::kFloat8E4M3:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float8_E4M3FN), 8, 1};
    case DType::kFloat8E5M2:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float8_E5M2), 8, 1};
  }
  return {static_cast<std::uint8_t>(dl::dtype_code::UInt), 8, 1};
}

dl::dtype uint_dtype(std::size_t bytes) {
  return {static_cast<std::uint8_t>(dl::dtype_code::UInt), static_cast<std::uint8_t>(bytes * 8), 1};
}

std::string dtype_name(dl::dtype d) {
  static const char* codes[] = {"int",           "uint",
                                "float",         "?",
                                "bfloat",        "complex",
                                "bool",          "float8_e3m4",
                                "float8_e4m3",   "float8_e4m3b11fnuz",
                                "float8_e4m3fn", "float8_e4m3fnuz",
                                "float8_e5m2",   "float8_e5m2fnuz",
                                "float8_e8m0fnu"};
  std::string c =
      d.code < sizeof(codes) / sizeof(codes[0]) ? codes[d.code] : "code" + std::to_string(d.code);
  if (c.rfind("float8", 0) == 0) return c;
  return c + std::to_string(d.bits);
}

// The tensor view of a cache, the one CudaIpcKVTransferInfo describes
// (KVLayout::view_shape): layer-major [L, kv, P, P0, P1, D], page-major
// [P, L, kv, P0, P1, D], layer_page [L, P, kv, P0, P1, D].
std::vector<std::size_t> view_shape(const KVLayout& l) {
  const auto shape = l.view_shape();
  return {shape.begin(), shape.end()};
}

std::string shape_str(const std::vector<std::size_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

namespace {

// Checks `a` against `layout` and returns its bytes, or throws naming the
// mismatch. Accepted: the layout's dtype (or an unsigned/signed integer of
// the same size, e.g. uint16 for bf16 in numpy) in the 6-D view shape or
// flat; or uint8 bytes, flat or in the view with the last axis in bytes.
// Always C-contiguous.
std::size_t check_tensor(const nb::ndarray<>& a, const KVLayout& layout) {
  const dl::dtype want = layout_dtype(layout.dtype);
  const dl::dtype got = a.dtype();
  const std::size_t es = layout.element_size();
  const bool same = got == want;
  const bool same_size_int = (got.code == static_cast<std::uint8_t>(dl::dtype_code::UInt) ||
                              got.code == static_cast<std::uint8_t>(dl::dtype_code::Int)) &&
                             got.bits == es * 8 && got.lanes == 1;
  const bool bytes = got == uint_dtype(1);
  if (!same && !same_size_int && !bytes) {
    throw Error(StatusCode::kInvalidArgument,
                "tensor dtype " + dtype_name(got) + " does not match the layout's dtype " +
                    std::string(to_string(layout.dtype)) + " (accepted: " + dtype_name(want) +
                    ", an integer type of " + std::to_string(es) + " bytes, or uint8)");
  }
  std::vector<std::size_t> shape(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = a.shape(i);
  std::vector<std::size_t> want_shape = view_shape(layout);
  const std::size_t item = got.bits / 8;
  if (item != es) want_shape.back() *= es / item;  // uint8 view: last axis in bytes
  const std::uint64_t total_items = layout.total_bytes() / item;
  const bool flat = shape.size() == 1 && shape[0] == total_items;
  if (!flat && shape != want_shape) {
    throw Error(StatusCode::kInvalidArgument,
                "tensor shape " + shape_str(shape) + " does not match the layout " +
                    layout.to_string() + ": expected " + shape_str(want_shape) + " " +
                    layout.view_axes() + " or flat [" + std::to_string(total_items) + "]");
  }
  // C-contiguous, in elements; axes of extent 1 may carry any stride.
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) {
      throw Error(StatusCode::kInvalidArgument,
                  "tensor stride " + std::to_string(a.stride(i)) + " (elements) at dim " +
                      std::to_string(i) + " is not C-contiguous (expected " +
                      std::to_string(expect) + "): pass tensor.contiguous()");
    }
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
  return layout.total_bytes();
}

PyKVCache from_dlpack(nb::handle obj, const KVLayout& layout) {
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a)) {
    const std::string type = nb::cast<std::string>(nb::str(obj.type().attr("__name__")));
    nb::ndarray<nb::ro> ro;
    if (nb::try_cast(obj, ro)) {
      throw Error(StatusCode::kInvalidArgument,
                  "tensor of type " + type + " is read-only: pulls write into the cache");
    }
    throw Error(StatusCode::kInvalidArgument,
                "object of type " + type +
                    " is not a tensor (it supports neither __dlpack__ nor the buffer protocol)");
  }
  layout.validate();
  const std::size_t size = check_tensor(a, layout);
  auto* data = static_cast<std::byte*>(a.data());
  std::unique_ptr<KVMemory> memory;
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value || dev == nb::device::cuda_host::value) {
    memory = std::make_unique<ForeignHostMemory>(data, size);
  } else if (dev == nb::device::cuda::value) {
#if MSTAR_KV_PY_HAVE_CUDA_IPC
    memory = wrap_device_memory(data, size, a.device_id());
#else
    throw Error(StatusCode::kUnavailable,
                "a CUDA tensor needs the cuda_ipc engine, which is not built into this mstar_kv");
#endif
  } else {
    throw Error(StatusCode::kInvalidArgument, "tensor on DLPack device type " +
                                                  std::to_string(dev) +
                                                  " is neither host (1, 3) nor CUDA (2) memory");
  }
  const int device = dev == nb::device::cuda::value ? static_cast<int>(a.device_id()) : 0;
  return cache_over_arrays(layout, std::move(memory), a, device);
}

// A cache of one region per layer has no one tensor view.
void require_one_region(const KVCache& c, const char* what) {
  if (c.split()) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(what) + ": this cache is " + std::to_string(c.num_regions()) +
                    " regions, one per layer (from_layer_tensors), and has no one tensor view: "
                    "use the layer tensors it was made from (regions lists their addresses)");
  }
}

// A view of the cache for numpy / DLPack, owned by `self` (the Python
// KVCache), so the memory lives as long as any view.
nb::ndarray<nb::array_api> as_ndarray(nb::handle self, bool numpy_dtype) {
  const PyKVCache& c = nb::cast<const PyKVCache&>(self);
  require_one_region(*c.cache, "a tensor view");
  const KVLayout& l = c.cache->layout();
  std::vector<std::size_t> shape = view_shape(l);
  dl::dtype dt = layout_dtype(l.dtype);
  if (numpy_dtype && (l.dtype == DType::kBFloat16 || l.element_size() == 1)) {
    dt = uint_dtype(l.element_size());  // numpy has no bf16 / fp8
  }
  int device_type = nb::device::cpu::value;
  int device_id = 0;
  if (c.cache->memory_kind() == MemoryKind::kDevice) {
#if MSTAR_KV_PY_HAVE_CUDA_IPC
    device_type = nb::device::cuda::value;
    device_id = c.device;
#endif
  }
  return nb::ndarray<nb::array_api>(c.cache->base(), shape.size(), shape.data(), self, nullptr, dt,
                                    device_type, device_id);
}

std::vector<std::uint32_t> pages_arg(nb::handle pages) { return to_pages(pages, "pages"); }

void require_host(const KVCache& c, const char* what) {
  if (c.memory_kind() == MemoryKind::kDevice) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(what) + " needs host memory; this cache is device memory");
  }
}

}  // namespace

void bind_cache(nb::module_& m) {
  nb::class_<PyKVCache>(
      m, "KVCache",
      "A KVLayout bound to memory of exactly layout.total_bytes bytes.\n\n"
      "KVCache(layout, memory='host'|'shared'|'device', device=0) allocates zero-filled "
      "memory: 'host' private, 'shared' an anonymous memfd other processes of this user "
      "can map (the shm engine), 'device' one cudaMalloc (the cuda_ipc engine). "
      "KVCache.from_dlpack(tensor, layout) wraps the caller's memory without a copy and "
      "keeps the tensor alive as long as the cache or any engine using it. The cache is "
      "visible to numpy/torch through __dlpack__ and (host memory) __array_interface__, "
      "as the 6-D view [L, kv, P, page_size, H, D] (layer-major NHD; page-major "
      "[P, L, kv, ...], layer_page [L, P, kv, ...]; HND swaps page_size and H; see view_shape). "
      "Immutable object; its bytes are not synchronised: write pages only while no "
      "transfer reads or writes them.")
      .def(
          "__init__",
          [](PyKVCache* self, const KVLayout& layout, const std::string& memory, int device) {
            std::shared_ptr<KVCache> c;
            {
              nb::gil_scoped_release release;  // large caches take a while to fault in
              c = make_kv_cache(layout, parse_memory(memory), device);
            }
            new (self) PyKVCache{std::move(c), device};
          },
          nb::arg("layout"), nb::arg("memory") = "host", nb::arg("device") = 0)
      .def_static("from_dlpack", &from_dlpack, nb::arg("tensor"), nb::arg("layout"),
                  "Wraps a C-contiguous tensor (numpy array, torch tensor, any __dlpack__ "
                  "object) whose dtype and shape match the layout; raises "
                  "InvalidArgumentError naming the mismatch. No copy.")
      .def_static(
          "from_layer_tensors", &from_layer_tensors, nb::arg("tensors"), nb::arg("layout"),
          "A cache of one region per layer over the caller's per-layer tensors (vLLM's "
          "register_kv_caches): tensors[l] holds layer l, C-contiguous, in the layout's dtype, "
          "shaped as one layer of the view without its layer axis (layer-major: [num_kv, "
          "num_pages, page_size, num_kv_heads, head_dim] for NHD) or flat, exactly "
          "layout.layer_bytes bytes, all on one device. No copy: the regions are the tensors' "
          "memory, kept alive with the cache. Raises InvalidArgumentError naming the layer and "
          "the expected against the given shape (or dtype, device, stride, count), and for a "
          "page-major layout (its layers are not contiguous) or tensors that overlap.")
      .def_prop_ro(
          "split", [](const PyKVCache& c) { return c.cache->split(); },
          "True for a cache of one region per layer (from_layer_tensors).")
      .def_prop_ro("num_regions", [](const PyKVCache& c) { return c.cache->num_regions(); })
      .def_prop_ro(
          "regions",
          [](const PyKVCache& c) {
            std::vector<std::tuple<std::uintptr_t, std::size_t>> out;
            const std::size_t each =
                c.cache->split() ? c.cache->layout().layer_bytes() : c.cache->size_bytes();
            for (std::size_t i = 0; i < c.cache->num_regions(); ++i) {
              out.emplace_back(c.cache->regions().base(i), each);
            }
            return out;
          },
          "[(address, bytes)] of each region: the whole cache, or one per layer in layer "
          "order.")
      .def_prop_ro("layout", [](const PyKVCache& c) { return c.cache->layout(); })
      .def_prop_ro(
          "memory", [](const PyKVCache& c) { return memory_name(c.cache->memory_kind()); },
          "'host', 'shared' or 'device'.")
      .def_prop_ro(
          "data_ptr",
          [](const PyKVCache& c) {
            require_one_region(*c.cache, "data_ptr");
            return reinterpret_cast<std::uintptr_t>(c.cache->base());
          },
          "Address of the cache's one region (a cache of one region per layer has none: see "
          "regions).")
      .def_prop_ro("size_bytes", [](const PyKVCache& c) { return c.cache->size_bytes(); })
      .def_prop_ro(
          "epochs_ptr",
          [](const PyKVCache& c) {
            return reinterpret_cast<std::uintptr_t>(c.cache->epochs().words());
          },
          "Address of the cache's page epoch table (layout.num_pages 8-byte words of host "
          "memory, written by the KVCachePool over this cache), for engines that register it.")
      .def_prop_ro("epochs_bytes",
                   [](const PyKVCache& c) { return c.cache->epochs().size_bytes(); })
      .def_prop_ro(
          "ready_ptr",
          [](const PyKVCache& c) {
            return reinterpret_cast<std::uintptr_t>(c.cache->readiness().words());
          },
          "Address of the cache's layer readiness words (layout.num_pages 4-byte words of host "
          "memory, written by the KVCachePool's publish / mark_layers_ready), for engines that "
          "register them.")
      .def_prop_ro(
          "ready_bytes",
          [](const PyKVCache& c) { return std::size_t{c.cache->readiness().num_pages()} * 4; })
      .def_prop_ro(
          "view_shape", [](const PyKVCache& c) { return view_shape(c.cache->layout()); },
          "Shape of the tensor view (__dlpack__, numpy()).")
      .def(
          "__dlpack__",
          [](nb::handle self, nb::kwargs kwargs) {
            return nb::cast(as_ndarray(self, false)).attr("__dlpack__")(**kwargs);
          },
          nb::arg("kwargs"), "DLPack export of the view (no copy; keeps the cache alive).")
      .def("__dlpack_device__",
           [](nb::handle self) {
             return nb::cast(as_ndarray(self, false)).attr("__dlpack_device__")();
           })
      .def(
          "numpy",
          [](nb::handle self) {
            const PyKVCache& c = nb::cast<const PyKVCache&>(self);
            require_host(*c.cache, "numpy()");
            return nb::module_::import_("numpy").attr("asarray")(nb::cast(as_ndarray(self, true)));
          },
          "The view as a numpy array without a copy (bf16 as uint16, fp8 as uint8: numpy "
          "has neither). Host memory only.")
      .def_prop_ro(
          "__array_interface__",
          [](const PyKVCache& c) {
            if (c.cache->memory_kind() == MemoryKind::kDevice) {
              throw Error(StatusCode::kInvalidArgument,
                          "a device cache has no __array_interface__ (use __dlpack__)");
            }
            require_one_region(*c.cache, "__array_interface__");
            const KVLayout& l = c.cache->layout();
            const char* typestr = l.dtype == DType::kFloat32    ? "<f4"
                                  : l.dtype == DType::kFloat16  ? "<f2"
                                  : l.dtype == DType::kBFloat16 ? "<u2"
                                                                : "|u1";
            nb::list shape;
            for (std::size_t d : view_shape(l)) shape.append(d);
            nb::dict d;
            d["shape"] = nb::tuple(shape);
            d["typestr"] = typestr;
            d["data"] = nb::make_tuple(reinterpret_cast<std::uintptr_t>(c.cache->base()), false);
            d["version"] = 3;
            return d;
          },
          "numpy's array interface over host memory (bf16 as uint16, fp8 as uint8); "
          "np.asarray(cache) is a view that keeps the cache alive.")
      .def(
          "fill_pattern",
          [](const PyKVCache& c, std::uint64_t seed, nb::handle pages, std::uint64_t start_len,
             std::uint64_t end_len,
             std::optional<std::tuple<std::uint32_t, std::uint32_t>> layers) {
            require_host(*c.cache, "fill_pattern");
            const auto p = pages_arg(pages);
            nb::gil_scoped_release release;
            if (layers) {
              fill_pattern_layers(*c.cache, seed, p, start_len, end_len, std::get<0>(*layers),
                                  std::get<1>(*layers));
            } else {
              fill_pattern(*c.cache, seed, p, start_len, end_len);
            }
          },
          nb::arg("seed"), nb::arg("pages"), nb::arg("start_len"), nb::arg("end_len"),
          nb::arg("layers").none() = nb::none(),
          "Writes the library's deterministic test pattern for tokens [start_len, end_len) "
          "of a sequence whose page table is `pages` (host memory); `layers` = (begin, end) "
          "writes only those layers (a layer-wise prefill).")
      .def(
          "verify_pattern",
          [](const PyKVCache& c, std::uint64_t seed, nb::handle pages, std::uint64_t start_len,
             std::uint64_t end_len) {
            require_host(*c.cache, "verify_pattern");
            const auto p = pages_arg(pages);
            VerifyResult r;
            {
              nb::gil_scoped_release release;
              r = verify_pattern(*c.cache, seed, p, start_len, end_len);
            }
            nb::dict d;
            d["ok"] = r.ok();
            d["blocks_checked"] = r.blocks_checked;
            d["bytes_checked"] = r.bytes_checked;
            d["mismatched_blocks"] = r.mismatched_blocks;
            d["first_mismatch"] = r.first_mismatch;
            return d;
          },
          nb::arg("seed"), nb::arg("pages"), nb::arg("start_len"), nb::arg("end_len"),
          "Checks every (layer, k|v, page) block of those tokens against the pattern; "
          "returns {'ok', 'blocks_checked', 'bytes_checked', 'mismatched_blocks', "
          "'first_mismatch'}.")
      .def("__repr__", [](const PyKVCache& c) {
        return std::string("KVCache(") + c.cache->layout().to_string() + ", memory='" +
               memory_name(c.cache->memory_kind()) + "'" +
               (c.cache->split()
                    ? ", regions=" + std::to_string(c.cache->num_regions()) + " (one per layer)"
                    : std::string()) +
               ")";
      });
}

}  // namespace mstar::kv::py
