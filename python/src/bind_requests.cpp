// Copyright mstar-kv authors.
//
// The request-scoped descriptor, bound: mstar_kv._core._RequestInfo is the
// C++ RequestKVTransferInfo (requests.hpp). mstar_kv.RequestKVTransferInfo
// wraps it (equality, hashing and pickling by its bytes, decoded lazily).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "mstar/kv/core/requests.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

void bind_requests(nb::module_& m) {
  nb::class_<RequestKVTransferInfo>(
      m, "_RequestInfo",
      "The C++ RequestKVTransferInfo: one publication of a request's labelled cache "
      "(mstar_kv.RequestKVTransferInfo wraps it).")
      .def_static(
          "from_bytes",
          [](const nb::bytes& b) {
            const auto* p = static_cast<const std::uint8_t*>(b.data());
            return RequestKVTransferInfo::decode(std::vector<std::uint8_t>(p, p + b.size()));
          },
          nb::arg("data"), "Untrusted decode (CorruptDescriptorError naming the field).")
      .def("to_bytes",
           [](const RequestKVTransferInfo& d) {
             const auto v = d.encode();
             return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
           })
      .def_ro("resource_key", &RequestKVTransferInfo::resource_key)
      .def_ro("request_id", &RequestKVTransferInfo::request_id)
      .def_ro("label", &RequestKVTransferInfo::label)
      .def_ro("reset_generation", &RequestKVTransferInfo::reset_generation)
      .def_ro("seq_len", &RequestKVTransferInfo::seq_len)
      .def_ro("page_size", &RequestKVTransferInfo::page_size)
      .def_ro("page_indices", &RequestKVTransferInfo::page_indices)
      .def_ro("page_epochs", &RequestKVTransferInfo::page_epochs)
      .def_ro("owner", &RequestKVTransferInfo::owner)
      .def_ro("cache", &RequestKVTransferInfo::cache)
      .def("__eq__",
           [](const RequestKVTransferInfo& a, const RequestKVTransferInfo& b) { return a == b; })
      .def("__eq__", [](const RequestKVTransferInfo&, nb::handle) { return false; });
}

}  // namespace mstar::kv::py
