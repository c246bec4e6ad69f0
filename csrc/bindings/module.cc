// kvbridge._C: the Python extension. Thin: it converts arguments, releases the GIL and calls
// the C++ API; the Python package (python/kvbridge) holds the user-facing classes.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "bindings/common.h"

namespace kvbridge::bindings {

PyStatus ToPy(const Status& s) {
  PyStatus p;
  p.code = static_cast<int>(s.code());
  p.name = StatusCodeName(s.code());
  p.message = s.ok() ? std::string() : s.message();
  p.origin = StatusOriginName(s.origin());
  return p;
}

namespace {

// Raises the kvbridge.errors exception for a StatusError (imported lazily: the Python package
// defines the hierarchy, keyed by code).
void TranslateStatusError(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const StatusError& e) {
    PyStatus s = ToPy(e.status());
    py::object exc = py::module_::import("kvbridge.errors")
                         .attr("from_status")(s.code, s.name, s.message, s.origin);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  }
}

}  // namespace

void BindCommon(py::module_& m) {
  py::dict codes;
  for (int c = 0; c < KVB_STATUS_CODE_COUNT; ++c) {
    codes[py::str(StatusCodeName(static_cast<StatusCode>(c)))] = c;
  }
  m.attr("STATUS_CODES") = codes;

  py::class_<PyStatus>(m, "Status",
                       "A per-op or per-key outcome: code (int), name, message, and origin: "
                       "'master' or 'storage_node' when the store says which side failed, "
                       "else ''.")
      .def_readonly("code", &PyStatus::code)
      .def_readonly("name", &PyStatus::name)
      .def_readonly("message", &PyStatus::message)
      .def_readonly("origin", &PyStatus::origin)
      .def_property_readonly("ok", &PyStatus::ok)
      .def("__bool__", &PyStatus::ok)
      .def("__repr__", [](const PyStatus& s) {
        return s.ok() ? std::string("Status(OK)") : "Status(" + s.name + ": " + s.message + ")";
      });

  py::register_exception_translator(&TranslateStatusError);

  // (address, length, read_only) of an object exporting the buffer protocol, C-contiguous.
  m.def(
      "buffer_address",
      [](py::buffer b, bool writable) {
        Py_buffer view;
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(b.ptr(), &view, flags) != 0) throw py::error_already_set();
        auto out = py::make_tuple(reinterpret_cast<uintptr_t>(view.buf),
                                  static_cast<uint64_t>(view.len), view.readonly != 0);
        PyBuffer_Release(&view);
        return out;
      },
      py::arg("obj"), py::arg("writable"));

  // memmove between raw addresses, GIL released (used by get_into's staging path).
  m.def(
      "memcopy",
      [](uintptr_t dst, uintptr_t src, uint64_t n) {
        py::gil_scoped_release release;
        std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      py::arg("dst"), py::arg("src"), py::arg("length"));
}

}  // namespace kvbridge::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvbridge native extension (use the kvbridge package, not this module)";
  namespace b = kvbridge::bindings;
  b::BindCommon(m);
  b::BindEngine(m);
  b::BindStore(m);
  b::BindKernels(m);
  b::BindPd(m);
}
