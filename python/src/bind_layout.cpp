// Copyright mstar-kv authors.
//
// KVLayout and KVReadInfo.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>

#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

namespace {

std::string read_info_repr(const KVReadInfo& r) {
  return "KVReadInfo(layer_idx=" + std::to_string(r.layer_idx) +
         ", local_page_idx=" + std::to_string(r.local_page_idx) +
         ", remote_page_idx=" + std::to_string(r.remote_page_idx) +
         ", token_start=" + std::to_string(r.token_start) +
         ", token_end=" + std::to_string(r.token_end) +
         (r.remote_token_start >= 0 ? ", remote_token_start=" + std::to_string(r.remote_token_start)
                                    : std::string()) +
         (r.head_start != 0 || r.head_end != 0 ? ", head_start=" + std::to_string(r.head_start) +
                                                     ", head_end=" + std::to_string(r.head_end)
                                               : std::string()) +
         ")";
}

using LayoutState =
    std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t,
               std::string, bool, std::string, std::string, std::uint32_t, std::uint32_t>;

LayoutState layout_state(const KVLayout& l) {
  return {l.num_layers,
          l.num_pages,
          l.page_size,
          l.num_kv_heads,
          l.head_dim,
          std::string(to_string(l.dtype)),
          l.has_v,
          std::string(to_string(l.cache_order)),
          std::string(to_string(l.page_order)),
          l.total_kv_heads,
          l.first_kv_head};
}

KVLayout make_layout(std::uint32_t num_layers, std::uint32_t num_pages, std::uint32_t page_size,
                     std::uint32_t num_kv_heads, std::uint32_t head_dim, const std::string& dtype,
                     bool has_v, const std::string& cache_order, const std::string& page_order,
                     std::uint32_t total_kv_heads, std::uint32_t first_kv_head) {
  const KVLayout l{.num_layers = num_layers,
                   .num_pages = num_pages,
                   .page_size = page_size,
                   .num_kv_heads = num_kv_heads,
                   .head_dim = head_dim,
                   .dtype = parse_dtype(dtype),
                   .has_v = has_v,
                   .cache_order = parse_cache_order(cache_order),
                   .page_order = parse_page_order(page_order),
                   .total_kv_heads = total_kv_heads,
                   .first_kv_head = first_kv_head};
  l.validate();
  return l;
}

}  // namespace

void bind_layout(nb::module_& m) {
  nb::class_<KVLayout>(m, "KVLayout",
                       "The geometry of one paged KV cache (value type, immutable).\n\n"
                       "cache_order 'layer': [layer][k|v][page][page bytes]; 'page': "
                       "[page][layer][k|v][page bytes]; 'layer_page': "
                       "[layer][page][k|v][page bytes] (torch [L, P, 2, T, H, D]). page_order "
                       "'nhd': [token][head][dim]; "
                       "'hnd': [head][token][dim]. dtype: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2. "
                       "has_v=False for MLA's single latent. Head shards (tensor parallelism): "
                       "the model has total_kv_heads KV heads (0: num_kv_heads) and this cache "
                       "holds [first_kv_head, first_kv_head + num_kv_heads) of them. The "
                       "constructor validates every field and raises InvalidArgumentError "
                       "naming the first outside its limit.")
      .def(nb::new_(&make_layout), nb::arg("num_layers"), nb::arg("num_pages"),
           nb::arg("page_size"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
           nb::arg("dtype") = "bf16", nb::arg("has_v") = true, nb::arg("cache_order") = "layer",
           nb::arg("page_order") = "nhd", nb::arg("total_kv_heads") = 0,
           nb::arg("first_kv_head") = 0)
      .def_ro("num_layers", &KVLayout::num_layers)
      .def_ro("num_pages", &KVLayout::num_pages)
      .def_ro("page_size", &KVLayout::page_size, "Tokens per page.")
      .def_ro("num_kv_heads", &KVLayout::num_kv_heads)
      .def_ro("head_dim", &KVLayout::head_dim)
      .def_ro("has_v", &KVLayout::has_v)
      .def_ro("total_kv_heads", &KVLayout::total_kv_heads,
              "The model's KV heads; 0 when the cache holds them all.")
      .def_ro("first_kv_head", &KVLayout::first_kv_head,
              "The model head index of this cache's head 0.")
      .def_prop_ro("model_kv_heads", &KVLayout::model_kv_heads)
      .def_prop_ro("dtype", [](const KVLayout& l) { return std::string(to_string(l.dtype)); })
      .def_prop_ro("cache_order",
                   [](const KVLayout& l) { return std::string(to_string(l.cache_order)); })
      .def_prop_ro("page_order",
                   [](const KVLayout& l) { return std::string(to_string(l.page_order)); })
      .def_prop_ro("element_size", &KVLayout::element_size, "Bytes per element.")
      .def_prop_ro("num_kv", &KVLayout::num_kv, "2 (K and V), or 1 for MLA.")
      .def_prop_ro("token_bytes", &KVLayout::token_bytes,
                   "Bytes of one token across all heads, one layer, one of k|v.")
      .def_prop_ro("block_bytes", &KVLayout::block_bytes,
                   "Bytes of one page of one layer, one of k|v.")
      .def_prop_ro("total_bytes", &KVLayout::total_bytes)
      .def_prop_ro(
          "view_shape",
          [](const KVLayout& l) {
            const auto s = l.view_shape();
            return nb::make_tuple(s[0], s[1], s[2], s[3], s[4], s[5]);
          },
          "The cache as a C-contiguous 6-D tensor (what KVCache.from_dlpack takes and "
          "__dlpack__ gives): 'layer' [L, kv, P, T, H, D], 'page' [P, L, kv, T, H, D], "
          "'layer_page' [L, P, kv, T, H, D]; HND pages swap T and H; kv is num_kv.")
      .def_prop_ro("layer_bytes", &KVLayout::layer_bytes,
                   "Bytes of one layer (K and V of every page).")
      .def_prop_ro("layer_contiguous", &KVLayout::layer_contiguous,
                   "True when each layer's bytes are one run (every order but page-major): the "
                   "cache may be one region per layer (KVCache.from_layer_tensors).")
      .def("check_compatible", &KVLayout::check_compatible, nb::arg("remote"),
           "Raises IncompatibleLayoutError naming the first field a read needs to match.")
      .def("is_compatible", &KVLayout::is_compatible, nb::arg("remote"))
      .def("__eq__", [](const KVLayout& a, const KVLayout& b) { return a == b; })
      .def("__hash__", [](const KVLayout& l) { return nb::hash(nb::cast(layout_state(l))); })
      .def("__repr__", [](const KVLayout& l) { return "KVLayout(" + l.to_string() + ")"; })
      .def("__getstate__", &layout_state)
      .def("__setstate__", [](KVLayout& self, const LayoutState& s) {
        new (&self)
            KVLayout(make_layout(std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s),
                                 std::get<4>(s), std::get<5>(s), std::get<6>(s), std::get<7>(s),
                                 std::get<8>(s), std::get<9>(s), std::get<10>(s)));
      });

  nb::class_<KVReadInfo>(m, "KVReadInfo",
                         "One page of one layer to read (K and V both): tokens [token_start, "
                         "token_end) of remote page remote_page_idx land at the same token "
                         "positions of local page local_page_idx. Valid when 0 <= token_start "
                         "< token_end <= page_size; engines check it before any byte moves.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](KVReadInfo* self, std::int64_t layer_idx, std::int64_t local_page_idx,
             std::int64_t remote_page_idx, std::int64_t token_start, std::int64_t token_end,
             std::int64_t remote_token_start, std::int64_t head_start, std::int64_t head_end) {
            new (self) KVReadInfo{layer_idx, local_page_idx,     remote_page_idx, token_start,
                                  token_end, remote_token_start, head_start,      head_end};
          },
          nb::arg("layer_idx"), nb::arg("local_page_idx"), nb::arg("remote_page_idx"),
          nb::arg("token_start"), nb::arg("token_end"), nb::arg("remote_token_start") = -1,
          nb::arg("head_start") = 0, nb::arg("head_end") = 0)
      .def_rw("layer_idx", &KVReadInfo::layer_idx)
      .def_rw("local_page_idx", &KVReadInfo::local_page_idx)
      .def_rw("remote_page_idx", &KVReadInfo::remote_page_idx)
      .def_rw("token_start", &KVReadInfo::token_start)
      .def_rw("token_end", &KVReadInfo::token_end)
      .def_rw("remote_token_start", &KVReadInfo::remote_token_start,
              "Where the tokens start in the remote page when page sizes differ; -1: at "
              "token_start.")
      .def_rw("head_start", &KVReadInfo::head_start,
              "Model KV heads [head_start, head_end) to read; 0, 0: every local head.")
      .def_rw("head_end", &KVReadInfo::head_end)
      .def("__eq__", [](const KVReadInfo& a, const KVReadInfo& b) { return a == b; })
      .def("__eq__", [](const KVReadInfo&, nb::handle) { return false; })
      .def("__repr__", &read_info_repr)
      .def("__getstate__",
           [](const KVReadInfo& r) {
             return std::make_tuple(r.layer_idx, r.local_page_idx, r.remote_page_idx, r.token_start,
                                    r.token_end, r.remote_token_start, r.head_start, r.head_end);
           })
      .def("__setstate__",
           [](KVReadInfo& self,
              const std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                               std::int64_t, std::int64_t, std::int64_t>& s) {
             new (&self) KVReadInfo{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s),
                                    std::get<4>(s), std::get<5>(s), std::get<6>(s), std::get<7>(s)};
           });
}

}  // namespace mstar::kv::py
