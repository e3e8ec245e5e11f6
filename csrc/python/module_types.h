#pragma once
// Adding the C types of torch_opaque._C to the module.

#include <Python.h>

namespace torch_opaque::python {

// Readies `type` and adds it to module `m` as `name`; false with a Python
// error set on failure.
inline bool add_type(PyObject* m, PyTypeObject* type, const char* name) {
  if (PyType_Ready(type) < 0) return false;
  Py_INCREF(type);
  if (PyModule_AddObject(m, name, reinterpret_cast<PyObject*>(type)) < 0) {
    Py_DECREF(type);
    return false;
  }
  return true;
}

} // namespace torch_opaque::python
