// flashkv._flashkv: the compiled half of the Python package (see python/flashkv/ for the rest).
#include <nanobind/stl/string.h>

#include <exception>

#include "bind.h"
#include "flashkv/core/device.h"

namespace nb = nanobind;

namespace {
PyObject* g_error_type = nullptr;  // flashkv.Error, a ValueError and a RuntimeError
}  // namespace

NB_MODULE(_flashkv, m) {
  m.doc() = "flashkv's compiled operators, planner and backend (use the flashkv package).";

  PyObject* bases = PyTuple_Pack(2, PyExc_ValueError, PyExc_RuntimeError);
  g_error_type = PyErr_NewExceptionWithDoc(
      "flashkv._flashkv.Error",
      "An error raised by flashkv: a bad argument (naming it, with the expected and the actual "
      "value) or a failed operation. A ValueError and a RuntimeError.",
      bases, nullptr);
  Py_DECREF(bases);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const flashkv::Error& e) {
      PyErr_SetString(g_error_type, e.what());
    }
  });

  m.def("built_with_cuda", &flashkv::built_with_cuda, "Whether this build has the CUDA kernels.");
  m.def("cuda_available", &flashkv::cuda_available,
        "Whether this build has CUDA and the process sees a GPU.");
  m.def(
      "device_info",
      [](const std::string& device) {
        const flashkv::DeviceInfo d = flashkv::device_info(flashkv::parse_device(device));
        nb::dict r;
        r["device"] = d.device.str();
        r["name"] = d.name;
        r["num_sms"] = d.num_sms;
        r["num_threads"] = d.num_threads;
        r["memory_bytes"] = d.memory_bytes;
        r["compute_capability"] = d.compute_capability;
        return r;
      },
      nb::arg("device"), "What the planner knows about a device ('cpu', 'cuda:N').");

  flashkv::py::bind_ops(m);
  flashkv::py::bind_parallel(m);  // before the backend, which takes a Communicator
  flashkv::py::bind_backend(m);
}
