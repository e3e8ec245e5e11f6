#include "op_call.h"

#include "direct_apply.h"
#include "module_types.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <optional>
#include <vector>

namespace torch_opaque::python {
namespace {

// How an argument of the schema is converted on the fast path.
enum class Kind : uint8_t { Tensor, OptionalTensor, Float, Int, Bool, Str, Other };

Kind kind_of(const c10::Argument& a) {
  const c10::TypePtr& t = a.type();  // SymInt reads as int
  switch (t->kind()) {
    case c10::TypeKind::TensorType: return Kind::Tensor;
    case c10::TypeKind::FloatType: return Kind::Float;
    case c10::TypeKind::IntType: return Kind::Int;
    case c10::TypeKind::BoolType: return Kind::Bool;
    case c10::TypeKind::StringType: return Kind::Str;
    case c10::TypeKind::OptionalType: {
      auto elem = t->castRaw<c10::OptionalType>()->getElementType();
      return elem->kind() == c10::TypeKind::TensorType ? Kind::OptionalTensor : Kind::Other;
    }
    default: return Kind::Other;
  }
}

struct Spec {
  c10::OperatorHandle op;
  std::vector<Kind> kinds;
  std::vector<PyObject*> names;               // interned argument names
  std::vector<std::optional<c10::IValue>> defaults;
  bool fast = true;                           // every argument is of a plain kind
  bool tensor_returns = true;                 // every return is a Tensor
};

struct OpCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* fallback;  // torch's `_op` for this overload
  Spec* spec;
};

// The argument converted for the fast path, or nullopt when it must take
// the fallback (a value of another Python type, or one that may override).
std::optional<c10::IValue> convert(Kind kind, PyObject* a) {
  switch (kind) {
    case Kind::OptionalTensor:
      if (a == Py_None) return c10::IValue();
      [[fallthrough]];
    case Kind::Tensor:
      if (THPVariable_Check(a) && !may_override(a)) return THPVariable_Unpack(a);
      return std::nullopt;
    case Kind::Float:
      if (PyFloat_CheckExact(a)) return PyFloat_AS_DOUBLE(a);
      return std::nullopt;
    case Kind::Int: {
      if (!PyLong_CheckExact(a)) return std::nullopt;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return std::nullopt;
      }
      return static_cast<int64_t>(v);
    }
    case Kind::Bool:
      if (PyBool_Check(a)) return a == Py_True;
      return std::nullopt;
    case Kind::Str: {
      if (!PyUnicode_CheckExact(a)) return std::nullopt;
      Py_ssize_t size = 0;
      const char* data = PyUnicode_AsUTF8AndSize(a, &size);
      if (!data) {
        PyErr_Clear();
        return std::nullopt;
      }
      return c10::IValue(std::string(data, static_cast<size_t>(size)));
    }
    case Kind::Other: return std::nullopt;
  }
  return std::nullopt;
}

// Fills `stack` from a call; false when the call must take the fallback.
bool build_stack(const Spec& spec, PyObject* const* args, size_t n, PyObject* kwnames,
                 torch::jit::Stack& stack) {
  const size_t n_args = spec.kinds.size();
  if (n > n_args) return false;
  PyObject* given[16] = {};
  std::vector<PyObject*> given_heap;
  PyObject** slots = given;
  if (n_args > 16) {
    given_heap.assign(n_args, nullptr);
    slots = given_heap.data();
  }
  for (size_t i = 0; i < n; ++i) slots[i] = args[i];
  if (kwnames) {
    const Py_ssize_t n_kw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < n_kw; ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      size_t i = 0;
      while (i < n_args && spec.names[i] != key &&
             PyUnicode_Compare(spec.names[i], key) != 0) {
        ++i;
      }
      if (PyErr_Occurred()) PyErr_Clear();
      if (i == n_args || slots[i] != nullptr) return false;  // torch reports it
      slots[i] = args[n + k];
    }
  }
  stack.reserve(std::max(n_args, spec.op.schema().returns().size()) + 2);  // as in direct_apply.cpp
  for (size_t i = 0; i < n_args; ++i) {
    if (slots[i] == nullptr) {
      if (!spec.defaults[i].has_value()) return false;
      stack.push_back(*spec.defaults[i]);
      continue;
    }
    std::optional<c10::IValue> v = convert(spec.kinds[i], slots[i]);
    if (!v.has_value()) return false;
    stack.push_back(std::move(*v));
  }
  return true;
}

PyObject* wrap_results(const Spec& spec, torch::jit::Stack& stack) {
  const size_t n_out = stack.size();
  auto one = [&](c10::IValue& v) -> PyObject* {
    if (spec.tensor_returns) return THPVariable_Wrap(std::move(v).toTensor());
    return torch::jit::toPyObject(std::move(v)).release().ptr();
  };
  if (n_out == 1) return one(stack[0]);
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n_out));
  if (!out) return nullptr;
  for (size_t k = 0; k < n_out; ++k) {
    PyObject* o = one(stack[k]);
    if (!o) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), o);
  }
  return out;
}

PyObject* op_call_call(PyObject* obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<OpCall*>(obj);
  const Spec& spec = *self->spec;
  if (spec.fast && !at::impl::torch_function_mode_enabled() &&
      !torch::jit::tracer::isTracing()) {
    torch::jit::Stack stack;
    if (build_stack(spec, args, PyVectorcall_NARGS(nargsf), kwnames, stack)) {
      spec.op.callBoxed(stack);
      return wrap_results(spec, stack);
    }
  }
  return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  END_HANDLE_TH_ERRORS
}

// OpCall(fallback, qualified_name, overload)
PyObject* op_call_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  HANDLE_TH_ERRORS
  PyObject* fallback;
  const char* name;
  const char* overload;
  static const char* kw[] = {"fallback", "qualified_name", "overload", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oss", const_cast<char**>(kw), &fallback,
                                   &name, &overload)) {
    return nullptr;
  }
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "OpCall: fallback must be callable");
    return nullptr;
  }
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  auto spec = std::make_unique<Spec>(Spec{handle, {}, {}, {}});
  const auto& schema = handle.schema();
  for (const c10::Argument& a : schema.arguments()) {
    const Kind k = kind_of(a);
    spec->fast = spec->fast && k != Kind::Other && !a.kwarg_only() && !a.is_out();
    spec->kinds.push_back(k);
    PyObject* n = PyUnicode_InternFromString(a.name().c_str());
    if (!n) return nullptr;
    spec->names.push_back(n);  // interned names live as long as the process
    spec->defaults.push_back(a.default_value());
  }
  for (const c10::Argument& r : schema.returns()) {
    spec->tensor_returns =
        spec->tensor_returns && r.real_type()->kind() == c10::TypeKind::TensorType;
  }
  spec->fast = spec->fast && !schema.is_mutable() && !schema.returns().empty();
  auto* self = reinterpret_cast<OpCall*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->vectorcall = op_call_call;
  Py_INCREF(fallback);
  self->fallback = fallback;
  self->spec = spec.release();
  return reinterpret_cast<PyObject*>(self);
  END_HANDLE_TH_ERRORS
}

int op_call_traverse(PyObject* obj, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<OpCall*>(obj)->fallback);
  return 0;
}

int op_call_clear(PyObject* obj) {
  Py_CLEAR(reinterpret_cast<OpCall*>(obj)->fallback);
  return 0;
}

void op_call_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<OpCall*>(obj);
  PyObject_GC_UnTrack(obj);
  op_call_clear(obj);
  delete self->spec;
  Py_TYPE(obj)->tp_free(obj);
}

Py_hash_t op_call_hash(PyObject* obj) {
  PyObject* f = reinterpret_cast<OpCall*>(obj)->fallback;
  return f ? PyObject_Hash(f) : _Py_HashPointer(obj);
}

PyObject* op_call_repr(PyObject* obj) {
  PyObject* f = reinterpret_cast<OpCall*>(obj)->fallback;
  return f ? PyObject_Repr(f) : PyUnicode_FromString("<OpCall>");
}

// Own attributes first (`fallback`), then the original's (`__module__`,
// `__name__`, ...), which torch sets and reads on `_op`.
PyObject* op_call_getattro(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GenericGetAttr(obj, name);
  if (v || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
  PyObject* f = reinterpret_cast<OpCall*>(obj)->fallback;
  if (!f) return nullptr;
  PyErr_Clear();
  return PyObject_GetAttr(f, name);
}

int op_call_setattro(PyObject* obj, PyObject* name, PyObject* value) {
  PyObject* f = reinterpret_cast<OpCall*>(obj)->fallback;
  if (!f) {
    PyErr_SetString(PyExc_AttributeError, "OpCall: no original op");
    return -1;
  }
  return PyObject_SetAttr(f, name, value);
}

PyObject* op_call_fallback(PyObject* obj, void*) {
  PyObject* f = reinterpret_cast<OpCall*>(obj)->fallback;
  if (!f) Py_RETURN_NONE;
  Py_INCREF(f);
  return f;
}

PyObject* op_call_fast(PyObject* obj, void*) {
  return PyBool_FromLong(reinterpret_cast<OpCall*>(obj)->spec->fast);
}

PyGetSetDef op_call_getset[] = {
    {"fallback", op_call_fallback, nullptr, "torch's original `_op`", nullptr},
    {"fast", op_call_fast, nullptr, "whether the schema allows the C-level path", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject OpCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

} // namespace

bool add_op_call_type(PyObject* m) {
  OpCallType.tp_name = "torch_opaque._C.OpCall";
  OpCallType.tp_basicsize = sizeof(OpCall);
  OpCallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  OpCallType.tp_doc =
      "The `_op` of a torch_opaque OpOverload: a C-level call with torch's `_op` as "
      "fallback (Note [Direct op call]).";
  OpCallType.tp_new = op_call_new;
  OpCallType.tp_dealloc = op_call_dealloc;
  OpCallType.tp_traverse = op_call_traverse;
  OpCallType.tp_clear = op_call_clear;
  OpCallType.tp_hash = op_call_hash;
  OpCallType.tp_repr = op_call_repr;
  OpCallType.tp_getattro = op_call_getattro;
  OpCallType.tp_setattro = op_call_setattro;
  OpCallType.tp_getset = op_call_getset;
  OpCallType.tp_call = PyVectorcall_Call;
  OpCallType.tp_vectorcall_offset = offsetof(OpCall, vectorcall);
  return add_type(m, &OpCallType, "OpCall");
}

} // namespace torch_opaque::python
