// Shared pieces of the Python extension (kvbridge._C): status -> exception translation, the
// closable handle every native object lives in, and buffer/tensor address helpers.
//
// GIL rule: a binding converts its Python arguments while holding the GIL, then releases it
// before any call that can block (I/O, waits, locks) and before taking any Handle lock, so a
// thread blocked inside kvbridge never holds the GIL and a Close() never deadlocks with a call.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvbridge/status.h"

namespace kvbridge::bindings {

namespace py = pybind11;

// Thrown by bindings for a non-OK Status; translated into the kvbridge.errors exception of
// that code (errors.from_status) on its way to Python.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)), what_(status_.ToString()) {}
  const Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

// A positive int of exactly type int (bool excluded), or nullopt (the pointer-list readers
// then hand the call to their general path). Needs the GIL.
inline std::optional<uint64_t> PositiveInt(PyObject* o) {
  if (!PyLong_CheckExact(o)) return std::nullopt;
  const unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // negative or too large
    return std::nullopt;
  }
  if (v == 0) return std::nullopt;
  return static_cast<uint64_t>(v);
}

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T Unwrap(Result<T>&& r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// Owns a native object until Close(). Calls run under a shared lock, Close() under an
// exclusive one, so Close() waits for calls in flight and later calls fail with UNAVAILABLE
// ("<what> is closed") instead of touching freed memory. Call With() with the GIL released.
template <typename T>
class Handle {
 public:
  Handle(std::unique_ptr<T> object, std::string what)
      : object_(std::move(object)), what_(std::move(what)) {}

  template <typename F>
  decltype(auto) With(F&& f) {
    std::shared_lock lock(mu_);
    if (!object_) throw StatusError(Status::Unavailable(what_ + " is closed"));
    return f(*object_);
  }
  // Destroys the object (GIL must be released: destructors join threads).
  void Close() {
    std::unique_ptr<T> doomed;
    {
      std::unique_lock lock(mu_);
      doomed = std::move(object_);
    }
  }
  bool closed() {
    std::shared_lock lock(mu_);
    return object_ == nullptr;
  }

 private:
  std::shared_mutex mu_;
  std::unique_ptr<T> object_;
  std::string what_;
};

// Runs f with the GIL released.
template <typename F>
decltype(auto) NoGil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

// A Python-visible copy of a Status.
struct PyStatus {
  int code = 0;
  std::string name = "OK";
  std::string message;
  std::string origin;  // StatusOriginName: "", "master" or "storage_node"
  bool ok() const { return code == 0; }
};
PyStatus ToPy(const Status& s);

void BindCommon(py::module_& m);
void BindEngine(py::module_& m);
void BindStore(py::module_& m);
void BindKernels(py::module_& m);
void BindPd(py::module_& m);

}  // namespace kvbridge::bindings
