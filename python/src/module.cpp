// Copyright mstar-kv authors.
//
// mstar_kv._core: the C++ library's types and engines for the Python package
// (python/mstar_kv). Users import mstar_kv, which wraps this module.
#include "py_common.hpp"

NB_MODULE(_core, m) {
  m.doc() =
      "Native core of mstar_kv (nanobind over the C++ library mstar::kv). "
      "Import mstar_kv instead: it adds the spec's engine classes, the manager "
      "and concurrent.futures futures on top of these types.";
  // Objects still referenced at interpreter exit (a daemon thread's, a
  // traceback's) are not leaks of the bindings; stay quiet about them.
  nanobind::set_leak_warnings(false);
  mstar::kv::py::bind_errors(m);
  mstar::kv::py::bind_callbacks(m);
  mstar::kv::py::bind_layout(m);
  mstar::kv::py::bind_cache(m);
  mstar::kv::py::bind_descriptors(m);
  mstar::kv::py::bind_requests(m);
  mstar::kv::py::bind_engines(m);
  mstar::kv::py::bind_mooncake(m);
  mstar::kv::py::bind_pool(m);
  mstar::kv::py::bind_manager(m);
}
