// Copyright mstar-kv authors.
//
// mstar::kv::Error -> the package's KVTransferError subclass for its code,
// with the C++ message unchanged; helpers every binding shares.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>

#include "py_common.hpp"

namespace mstar::kv::py {

namespace {

// The package's factory(code: int, message: str) -> exception instance,
// installed by mstar_kv/errors.py. Leaked on purpose: it must outlive every
// engine thread that may still translate an error during finalisation.
PyObject* g_error_factory = nullptr;

void raise_error(const Error& e) {
  if (g_error_factory != nullptr) {
    PyObject* exc = PyObject_CallFunction(g_error_factory, "is", static_cast<int>(e.code()),
                                          e.status().message().c_str());
    if (exc != nullptr) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
      Py_DECREF(exc);
      return;
    }
    PyErr_Clear();
  }
  PyErr_SetString(PyExc_RuntimeError, e.what());
}

}  // namespace

bool python_alive() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

void bind_errors(nb::module_& m) {
  nb::enum_<StatusCode>(m, "StatusCode", nb::is_arithmetic(),
                        "mstar::kv::StatusCode: the outcome of a call or a transfer.")
      .value("OK", StatusCode::kOk)
      .value("IN_PROGRESS", StatusCode::kInProgress)
      .value("RETRY_LATER", StatusCode::kRetryLater)
      .value("INVALID_ARGUMENT", StatusCode::kInvalidArgument)
      .value("INCOMPATIBLE_LAYOUT", StatusCode::kIncompatibleLayout)
      .value("CORRUPT_DESCRIPTOR", StatusCode::kCorruptDescriptor)
      .value("STALE_DESCRIPTOR", StatusCode::kStaleDescriptor)
      .value("PERMISSION_DENIED", StatusCode::kPermissionDenied)
      .value("NOT_FOUND", StatusCode::kNotFound)
      .value("UNAVAILABLE", StatusCode::kUnavailable)
      .value("PEER_FAILURE", StatusCode::kPeerFailure)
      .value("TIMEOUT", StatusCode::kTimeout)
      .value("CANCELLED", StatusCode::kCancelled)
      .value("SHUTDOWN", StatusCode::kShutdown)
      .value("INTERNAL", StatusCode::kInternal)
      .value("NOT_SUPPORTED", StatusCode::kNotSupported);

  m.def(
      "_set_error_factory",
      [](nb::handle factory) {
        Py_XINCREF(factory.ptr());
        PyObject* old = g_error_factory;
        g_error_factory = factory.ptr();
        Py_XDECREF(old);
      },
      nb::arg("factory"),
      "Installs factory(code: int, message: str) -> exception, used for every "
      "mstar::kv::Error (mstar_kv.errors does this at import).");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });
}

}  // namespace mstar::kv::py
