#include "python_kernel.h"

#include <torch_opaque/forward_record.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>
#include <optional>
#include <vector>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

// How each argument / return is converted, worked out once per schema: the
// common cases (tensors, lists of optional tensors) skip the generic
// IValue <-> PyObject conversion.
enum class Kind : uint8_t { Generic, Tensor, ScalarType, TensorList, OptTensorList };

struct Kinds {
  std::vector<Kind> args, rets;
};

bool is_list_of(const c10::TypePtr& t, bool optional) {
  if (t->kind() != c10::TypeKind::ListType) return false;
  const auto& e = t->containedType(0);
  if (!optional) return e->kind() == c10::TypeKind::TensorType;
  return e->kind() == c10::TypeKind::OptionalType &&
      e->containedType(0)->kind() == c10::TypeKind::TensorType;
}

Kind kind_of(const c10::Argument& a) {
  const auto& real = a.real_type();
  if (real->kind() == c10::TypeKind::TensorType) return Kind::Tensor;
  if (real->kind() == c10::TypeKind::ScalarTypeType) return Kind::ScalarType;
  if (is_list_of(a.type(), false)) return Kind::TensorList;
  if (is_list_of(a.type(), true)) return Kind::OptTensorList;
  return Kind::Generic;
}

Kinds kinds_of(const c10::FunctionSchema& schema) {
  Kinds k;
  for (const auto& a : schema.arguments()) k.args.push_back(kind_of(a));
  for (const auto& r : schema.returns()) k.rets.push_back(kind_of(r));
  return k;
}

PyObject* wrap_tensor(const at::Tensor& t) {
  PyObject* o = THPVariable_Wrap(t);
  if (!o) throw py::error_already_set();
  return o;
}

PyObject* to_python(const c10::IValue& v, Kind kind, bool tuples) {
  switch (kind) {
    case Kind::Tensor:
      if (v.isTensor()) return wrap_tensor(v.toTensor());
      break;
    case Kind::ScalarType:
      if (v.isInt()) {
        auto* dtype = torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()));
        Py_INCREF(dtype);
        return reinterpret_cast<PyObject*>(dtype);
      }
      break;
    case Kind::TensorList:
    case Kind::OptTensorList:
      if (v.isList()) {
        const auto& items = v.toListRef();
        const auto n = static_cast<Py_ssize_t>(items.size());
        PyObject* l = tuples ? PyTuple_New(n) : PyList_New(n);
        if (!l) throw py::error_already_set();
        for (Py_ssize_t j = 0; j < n; ++j) {
          PyObject* o;
          if (items[j].isTensor()) {
            o = wrap_tensor(items[j].toTensor());
          } else {
            Py_INCREF(Py_None);
            o = Py_None;
          }
          if (tuples) {
            PyTuple_SET_ITEM(l, j, o);
          } else {
            PyList_SET_ITEM(l, j, o);
          }
        }
        return l;
      }
      break;
    case Kind::Generic:
      if (v.isString() && v.toStringRef().empty()) {
        static PyObject* empty = PyUnicode_FromString("");
        Py_INCREF(empty);
        return empty;
      }
      if (tuples && v.isList() && v.toListRef().empty()) {
        return PyTuple_New(0);
      }
      if (tuples && v.isBoolList()) {
        const auto l = v.toBoolList();
        PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(l.size()));
        if (!t) throw py::error_already_set();
        for (size_t j = 0; j < l.size(); ++j) {
          PyObject* b = l.get(j) ? Py_True : Py_False;
          Py_INCREF(b);
          PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(j), b);
        }
        return t;
      }
      break;
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// The record a Python forward kernel returns: (saved, non_differentiable,
// materialize_grads, state, state_ints).
void report_record(PyObject* rec, const c10::FunctionSchema& schema) {
  if (rec == Py_None) return;
  TORCH_CHECK(PyTuple_Check(rec) && PyTuple_GET_SIZE(rec) == 5, schema.name(),
              ": malformed forward record");
  ForwardRecord r;
  PyObject* saved = PyTuple_GET_ITEM(rec, 0);
  TORCH_CHECK(PyList_Check(saved) && PyList_GET_SIZE(saved) % 3 == 0, schema.name(),
              ": malformed saved spec");
  const Py_ssize_t n = PyList_GET_SIZE(saved);
  r.saved.reserve(n / 3);
  for (Py_ssize_t i = 0; i < n; i += 3) {
    const long long kind = PyLong_AsLongLong(PyList_GET_ITEM(saved, i));
    TORCH_CHECK(kind >= 0 && kind <= 4, schema.name(), ": bad saved kind ", kind);
    r.saved.push_back({static_cast<SavedKind>(kind),
                       PyLong_AsLongLong(PyList_GET_ITEM(saved, i + 1)),
                       PyLong_AsLongLong(PyList_GET_ITEM(saved, i + 2))});
  }
  PyObject* nd = PyTuple_GET_ITEM(rec, 1);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nd); ++i) {
    r.non_differentiable.push_back(PyList_GET_ITEM(nd, i) == Py_True);
  }
  r.materialize_grads = PyTuple_GET_ITEM(rec, 2) == Py_True;
  PyObject* state = PyTuple_GET_ITEM(rec, 3);
  if (PyUnicode_GET_LENGTH(state) > 0) r.state = py::cast<std::string>(state);
  PyObject* ints = PyTuple_GET_ITEM(rec, 4);
  if (PyList_GET_SIZE(ints) > 0) r.state_ints = py::cast<std::vector<c10::SymInt>>(ints);
  set_forward_record(std::move(r));
}

// Note [Kernel outputs never alias inputs]
// An operator's outputs may not alias its inputs or each other (functionalization
// and torch.library.opcheck rely on it), but user code often returns `x` or `grad`
// itself, or saves a view. The bridge copies any returned tensor that shares
// storage with an argument tensor or an earlier returned tensor. Fake kernels
// (Python) apply the same rule in torch_opaque/kernels.py.
class Unaliaser {
 public:
  void add(const c10::IValue& v) {
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add(e.toTensor());
      }
    }
  }
  at::Tensor operator()(at::Tensor t) {
    if (!t.defined() || !t.has_storage()) return t;
    for (const auto& x : seen_) {
      if (t.is_alias_of(x)) {
        t = t.clone();
        break;
      }
    }
    seen_.push_back(t);
    return t;
  }

 private:
  void add(const at::Tensor& t) {
    if (t.defined() && t.has_storage()) seen_.push_back(t);
  }
  std::vector<at::Tensor> seen_;
};

at::Tensor unpack_tensor(PyObject* o, const c10::FunctionSchema& schema, size_t i) {
  TORCH_CHECK(THPVariable_Check(o), schema.name(), ": the Python kernel returned a ",
              Py_TYPE(o)->tp_name, " where return ", i, " must be a Tensor.");
  return THPVariable_Unpack(o);
}

void push_return(PyObject* item, Kind kind, const c10::FunctionSchema& schema, size_t i,
                 Unaliaser& unalias, torch::jit::Stack* stack) {
  if (kind == Kind::Tensor) {
    stack->emplace_back(unalias(unpack_tensor(item, schema, i)));
    return;
  }
  if ((kind == Kind::TensorList || kind == Kind::OptTensorList) &&
      (PyList_Check(item) || PyTuple_Check(item))) {
    const Py_ssize_t m = PySequence_Fast_GET_SIZE(item);
    if (kind == Kind::TensorList) {
      c10::List<at::Tensor> l;
      l.reserve(m);
      for (Py_ssize_t j = 0; j < m; ++j) {
        l.push_back(unalias(unpack_tensor(PySequence_Fast_GET_ITEM(item, j), schema, i)));
      }
      stack->emplace_back(std::move(l));
    } else {
      c10::List<std::optional<at::Tensor>> l;
      l.reserve(m);
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* e = PySequence_Fast_GET_ITEM(item, j);
        if (e == Py_None) {
          l.push_back(std::nullopt);
        } else {
          l.push_back(unalias(unpack_tensor(e, schema, i)));
        }
      }
      stack->emplace_back(std::move(l));
    }
    return;
  }
  stack->push_back(torch::jit::toIValue(py::handle(item), schema.returns()[i].type()));
}

} // namespace

BoxedKernel make_python_kernel(py::object fn, KernelRole role) {
  // Kernels live for the rest of the process (see all_ops()), so the callable
  // is deliberately never released: releasing it at exit would need the GIL
  // after the interpreter is gone.
  auto* holder = new py::object(std::move(fn));
  auto kinds = std::make_shared<std::optional<Kinds>>();
  const bool forward = role == KernelRole::Forward;
  const bool tuples = role == KernelRole::Backward;
  return [holder, kinds, forward, tuples](const c10::FunctionSchema& schema,
                                          torch::jit::Stack* stack) {
    std::optional<std::vector<bool>> needs;
    if (forward) needs = take_needs_input_grad();
    py::gil_scoped_acquire gil;
    if (!kinds->has_value()) *kinds = kinds_of(schema);
    const Kinds& k = **kinds;
    // A forward kernel gets `_fwd`'s schema without its last argument
    // (needs_input_grad, passed as the callable's first argument instead).
    const size_t n = k.args.size() - (forward ? 1 : 0);
    const size_t first = forward ? 1 : 0;
    py::tuple py_args(n + first);
    if (forward) {
      PyObject* nig = Py_None;
      if (needs) {
        nig = PyTuple_New(static_cast<Py_ssize_t>(needs->size()));
        if (!nig) throw py::error_already_set();
        for (size_t j = 0; j < needs->size(); ++j) {
          PyObject* b = (*needs)[j] ? Py_True : Py_False;
          Py_INCREF(b);
          PyTuple_SET_ITEM(nig, static_cast<Py_ssize_t>(j), b);
        }
      } else {
        Py_INCREF(Py_None);
      }
      PyTuple_SET_ITEM(py_args.ptr(), 0, nig);
    }
    Unaliaser unalias;
    auto values = torch::jit::last(*stack, n);
    for (size_t i = 0; i < n; ++i) {
      unalias.add(values[i]);
      PyTuple_SET_ITEM(py_args.ptr(), static_cast<Py_ssize_t>(i + first),
                       to_python(values[i], k.args[i], tuples));
    }
    torch::jit::drop(*stack, n);
    PyObject* res = PyObject_Call(holder->ptr(), py_args.ptr(), nullptr);
    if (!res) throw py::error_already_set();
    py::object result = py::reinterpret_steal<py::object>(res);
    const size_t expected = k.rets.size() + (forward ? 1 : 0);
    TORCH_CHECK(PyTuple_Check(res) &&
                    PyTuple_GET_SIZE(res) == static_cast<Py_ssize_t>(expected),
                schema.name(), ": the Python kernel must return a tuple of ", expected,
                " values.");
    for (size_t i = 0; i < k.rets.size(); ++i) {
      push_return(PyTuple_GET_ITEM(res, i), k.rets[i], schema, i, unalias, stack);
    }
    if (forward) report_record(PyTuple_GET_ITEM(res, k.rets.size()), schema);
  };
}

} // namespace torch_opaque::python
