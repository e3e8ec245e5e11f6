#include "direct_apply.h"

#include "module_types.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/PythonTorchFunctionTLS.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_opaque::python {

bool may_override(PyObject* o) {
  if (THPVariable_CheckExact(o) || o == Py_None || PyLong_CheckExact(o) ||
      PyFloat_CheckExact(o) || PyBool_Check(o) || PyUnicode_CheckExact(o)) {
    return false;
  }
  static PyObject* name = PyUnicode_InternFromString("__torch_function__");
  static PyObject* disabled = [] {
    PyObject* torch_c = PyImport_ImportModule("torch._C");
    PyObject* impl =
        torch_c ? PyObject_GetAttrString(torch_c, "_disabled_torch_function_impl") : nullptr;
    Py_XDECREF(torch_c);
    PyErr_Clear();
    return impl;  // kept for the life of the process
  }();
  PyObject* impl = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(o)), name);
  if (!impl) {
    PyErr_Clear();
    return false;
  }
  const bool overrides = impl != disabled;
  Py_DECREF(impl);
  return overrides;
}

namespace {

// One registered argument-type signature and the overload it calls.
struct Entry {
  std::vector<PyTypeObject*> types;  // exact argument types (strong references)
  c10::OperatorHandle op;
  std::vector<bool> tensor_arg;      // schema argument i is a Tensor / Tensor?
  bool wrap_single = false;          // return a 1-tuple for a single output
};

constexpr size_t kMaxEntries = 16;

struct DirectApply {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;      // __name__, __qualname__, __signature__ (set by Python)
  PyObject* cls;       // the wrapped Function class
  PyObject* fallback;  // Python apply: fallback(cls, *args, **kwargs)
  std::vector<Entry>* entries;
};

const Entry* match(const DirectApply* self, PyObject* const* args, size_t n) {
  for (const Entry& e : *self->entries) {
    if (e.types.size() != n) continue;
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) ok = Py_TYPE(args[i]) == e.types[i];
    if (ok) return &e;
  }
  return nullptr;
}

PyObject* call_entry(const Entry& e, PyObject* const* args, size_t n) {
  const auto& schema = e.op.schema();
  torch::jit::Stack stack;
  // (+2: the Autograd kernel pushes `_fwd`'s needs_input_grad, `_fwd` returns its
  // residuals too: no reallocation on the way.)
  stack.reserve(std::max(n, schema.returns().size()) + 2);
  for (size_t i = 0; i < n; ++i) {
    PyObject* a = args[i];
    if (e.tensor_arg[i] && THPVariable_Check(a)) {
      stack.emplace_back(THPVariable_Unpack(a));
    } else if (a == Py_None) {
      stack.emplace_back();
    } else {
      stack.push_back(torch::jit::toIValue(a, schema.arguments()[i].real_type()));
    }
  }
  const bool wrap_single = e.wrap_single;
  e.op.callBoxed(stack);
  const size_t n_out = stack.size();
  if (n_out == 1 && !wrap_single) {
    return THPVariable_Wrap(std::move(stack[0]).toTensor());
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n_out));
  if (!out) return nullptr;
  for (size_t k = 0; k < n_out; ++k) {
    PyObject* o = THPVariable_Wrap(std::move(stack[k]).toTensor());
    if (!o) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), o);
  }
  return out;
}

PyObject* direct_apply_call(PyObject* obj, PyObject* const* args, size_t nargsf,
                            PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<DirectApply*>(obj);
  const size_t n = PyVectorcall_NARGS(nargsf);
  // args[0] is the class the classmethod was looked up on.
  if (kwnames == nullptr && n >= 1 && args[0] == self->cls) {
    if (const Entry* e = match(self, args + 1, n - 1)) {
      bool plain = !at::impl::torch_function_mode_enabled();
      for (size_t i = 1; i < n && plain; ++i) plain = !may_override(args[i]);
      if (plain) return call_entry(*e, args + 1, n - 1);
    }
  }
  return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  END_HANDLE_TH_ERRORS
}

PyObject* direct_apply_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject *cls, *fallback;
  static const char* kw[] = {"cls", "fallback", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", const_cast<char**>(kw), &cls,
                                   &fallback)) {
    return nullptr;
  }
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "DirectApply: fallback must be callable");
    return nullptr;
  }
  auto* self = reinterpret_cast<DirectApply*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->vectorcall = direct_apply_call;
  Py_INCREF(cls);
  self->cls = cls;
  Py_INCREF(fallback);
  self->fallback = fallback;
  self->entries = new std::vector<Entry>();
  // Never reallocated: a call holds a pointer to its entry while the user's
  // forward runs, and that forward may call apply with new types (add()).
  self->entries->reserve(kMaxEntries);
  return reinterpret_cast<PyObject*>(self);
}

int direct_apply_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<DirectApply*>(obj);
  Py_VISIT(self->dict);
  Py_VISIT(self->cls);
  Py_VISIT(self->fallback);
  return 0;
}

int direct_apply_clear(PyObject* obj) {
  auto* self = reinterpret_cast<DirectApply*>(obj);
  Py_CLEAR(self->dict);
  Py_CLEAR(self->cls);
  Py_CLEAR(self->fallback);
  return 0;
}

void direct_apply_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<DirectApply*>(obj);
  PyObject_GC_UnTrack(obj);
  direct_apply_clear(obj);
  if (self->entries) {
    for (auto& e : *self->entries) {
      for (PyTypeObject* t : e.types) Py_DECREF(t);
    }
    delete self->entries;
  }
  Py_TYPE(obj)->tp_free(obj);
}

// add(types, qualified_name, overload, wrap_single)
PyObject* direct_apply_add(PyObject* obj, PyObject* args) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<DirectApply*>(obj);
  PyObject* types;
  const char* name;
  const char* overload;
  int wrap_single;
  if (!PyArg_ParseTuple(args, "O!ssp", &PyTuple_Type, &types, &name, &overload,
                        &wrap_single)) {
    return nullptr;
  }
  if (self->entries->size() >= kMaxEntries) Py_RETURN_FALSE;
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
      PyErr_SetString(PyExc_TypeError, "DirectApply.add: types must hold types");
      return nullptr;
    }
  }
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  const auto& schema = handle.schema();
  TORCH_CHECK(schema.arguments().size() == static_cast<size_t>(n),
              "DirectApply.add: ", name, ".", overload, " takes ",
              schema.arguments().size(), " arguments, got ", n, " types");
  for (const auto& r : schema.returns()) {
    TORCH_CHECK(r.type()->kind() == c10::TypeKind::TensorType,
                "DirectApply.add: ", name, " must return tensors only");
  }
  Entry e{{}, handle, {}, wrap_single != 0};
  for (Py_ssize_t i = 0; i < n; ++i) {
    auto* t = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(types, i));
    Py_INCREF(t);
    e.types.push_back(t);
    e.tensor_arg.push_back(schema.arguments()[i].real_type()->kind() ==
                           c10::TypeKind::TensorType);
  }
  self->entries->push_back(std::move(e));
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* direct_apply_size(PyObject* obj, PyObject*) {
  return PyLong_FromSize_t(reinterpret_cast<DirectApply*>(obj)->entries->size());
}

PyMethodDef direct_apply_methods[] = {
    {"add", direct_apply_add, METH_VARARGS,
     "add(types, qualified_name, overload, wrap_single) -> bool: route positional "
     "calls whose argument types are exactly `types` to the op (False when full)."},
    {"size", direct_apply_size, METH_NOARGS, "number of registered signatures"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef direct_apply_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject DirectApplyType = {PyVarObject_HEAD_INIT(nullptr, 0)};

} // namespace

bool add_direct_apply_type(PyObject* m) {
  DirectApplyType.tp_name = "torch_opaque._C.DirectApply";
  DirectApplyType.tp_basicsize = sizeof(DirectApply);
  DirectApplyType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
                             Py_TPFLAGS_HAVE_VECTORCALL;
  DirectApplyType.tp_doc =
      "Cls.apply of a wrapped Function: a C-level fast path with a Python fallback "
      "(Note [Direct apply]).";
  DirectApplyType.tp_new = direct_apply_new;
  DirectApplyType.tp_dealloc = direct_apply_dealloc;
  DirectApplyType.tp_traverse = direct_apply_traverse;
  DirectApplyType.tp_clear = direct_apply_clear;
  DirectApplyType.tp_methods = direct_apply_methods;
  DirectApplyType.tp_getset = direct_apply_getset;
  DirectApplyType.tp_dictoffset = offsetof(DirectApply, dict);
  DirectApplyType.tp_call = PyVectorcall_Call;
  DirectApplyType.tp_vectorcall_offset = offsetof(DirectApply, vectorcall);
  return add_type(m, &DirectApplyType, "DirectApply");
}

} // namespace torch_opaque::python
