// The Python type of an op call's backward node: Note [Backward node
// introspection] (csrc/autograd_kernel.h). torch wraps C++ autograd nodes in
// the Python type registered for their C++ type (registerCppFunction); this
// one adds what a stock Function's grad_fn (its ctx) shows: saved_tensors,
// _raw_saved_tensors, needs_input_grad, _forward_cls and the attributes forward set on ctx, all
// read-only. torch_opaque/_impl/grad_fn.py finds the Function and decodes
// encoded ctx state.

#include "backward_node_type.h"

#include "python_kernel.h"

#include "../autograd_kernel.h"

#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

using namespace torch::autograd;  // THPCppFunction and its default properties

detail::OpaqueNodeState state_of(PyObject* self, bool with_saved) {
  return detail::opaque_node_state(*reinterpret_cast<THPCppFunction*>(self)->cdata, with_saved);
}

py::object helpers() { return py::module_::import("torch_opaque._impl.grad_fn"); }

py::tuple tensors_tuple(const std::vector<at::Tensor>& ts) {
  py::tuple t(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    t[i] = ts[i].defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(ts[i]))
                           : py::none();
  }
  return t;
}

// (explicitly saved tensors, attribute dict or None) as backward's ctx has
// them; saved tensors only `with_saved` (None then) unless the attributes
// are encoded among them.
py::tuple ctx_view(PyObject* self, bool with_saved) {
  detail::OpaqueNodeState s = state_of(self, with_saved);
  PyObject* attrs = eager_ctx_attributes(s.eager_state);
  if (!with_saved && !attrs && !s.state.empty()) s = state_of(self, true);
  py::object saved = with_saved || !s.saved.empty() ? py::object(tensors_tuple(s.saved)) : py::none();
  if (attrs) return py::make_tuple(saved, py::reinterpret_borrow<py::object>(attrs));
  if (s.state.empty()) return py::make_tuple(saved, py::none());
  const OpDefinition& d = *s.definition;
  return helpers().attr("decode")(d.ns, d.name, d.overload, s.state, saved, s.state_ints);
}

PyObject* saved_tensors(PyObject* self, void*) {
  HANDLE_TH_ERRORS
  return py::object(ctx_view(self, /*with_saved=*/true)[0]).release().ptr();
  END_HANDLE_TH_ERRORS
}

// Note [Raw saved tensors] (autograd_kernel.h): torch's own SavedTensor
// objects, each keeping the node's Python object (hence the node) alive.
PyObject* raw_saved_tensors(PyObject* self, void*) {
  HANDLE_TH_ERRORS
  auto& saved = detail::opaque_node_saved_variables(*reinterpret_cast<THPCppFunction*>(self)->cdata);
  // the explicitly saved ones (tensor attributes of ctx encoded among them follow)
  const detail::OpaqueNodeState s = state_of(self, false);
  size_t n = saved.size();
  if (!eager_ctx_attributes(s.eager_state) && !s.state.empty()) {
    n = std::min(n, helpers().attr("explicit_count")(s.state).cast<size_t>());
  }
  py::tuple t(n);
  for (size_t i = 0; i < n; ++i) {
    t[i] = py::cast(saved[i], py::return_value_policy::reference_internal, py::handle(self));
  }
  return t.release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* needs_input_grad(PyObject* self, void*) {
  HANDLE_TH_ERRORS
  const detail::OpaqueNodeState s = state_of(self, false);
  py::tuple t(s.needs_input_grad.size());
  for (size_t i = 0; i < s.needs_input_grad.size(); ++i) t[i] = py::bool_(s.needs_input_grad[i]);
  return t.release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* forward_cls(PyObject* self, void*) {
  HANDLE_TH_ERRORS
  const OpDefinition& d = *state_of(self, false).definition;
  return helpers().attr("forward_cls")(d.ns, d.name).release().ptr();
  END_HANDLE_TH_ERRORS
}

// Attributes the type does not define: those forward set on ctx.
PyObject* getattro(PyObject* self, PyObject* name) {
  PyObject* found = PyObject_GenericGetAttr(self, name);
  if (found || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  HANDLE_TH_ERRORS
  py::object attrs = ctx_view(self, /*with_saved=*/false)[1];
  if (!attrs.is_none()) {
    PyObject* v = PyDict_GetItemWithError(attrs.ptr(), name);  // borrowed
    if (v) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      Py_INCREF(v);
      return v;
    }
    if (PyErr_Occurred()) throw py::error_already_set();
  }
  PyErr_Restore(type, value, tb);
  return nullptr;
  END_HANDLE_TH_ERRORS
}

// The properties torch gives every C++ node, and ours.
PyGetSetDef properties[] = {
    THP_FUNCTION_DEFAULT_PROPERTIES,
    {"saved_tensors", saved_tensors, nullptr,
     "The tensors forward saved with ctx.save_for_backward (read-only).", nullptr},
    {"_raw_saved_tensors", raw_saved_tensors, nullptr,
     "The saved tensors as torch._C._autograd.SavedTensor objects, for register_hooks "
     "(read-only).", nullptr},
    {"needs_input_grad", needs_input_grad, nullptr,
     "ctx.needs_input_grad of the forward call (read-only).", nullptr},
    {"_forward_cls", forward_cls, nullptr,
     "The autograd.Function class whose op made this node (None for a C++ op).", nullptr},
    {nullptr}};

// torch's default methods, less _set_sequence_nr (not exported by libtorch_python).
PyMethodDef methods[] = {
    {"_register_hook_dict", THPCppFunction_register_hook_dict, METH_O, nullptr},
    {"register_hook", THPCppFunction_register_hook, METH_O, nullptr},
    {"register_prehook", THPCppFunction_register_prehook, METH_O, nullptr},
    {"name", THPCppFunction_name, METH_NOARGS, nullptr},
    {"_sequence_nr", THPCppFunction_sequence_nr, METH_NOARGS, nullptr},
    {nullptr}};

PyTypeObject node_type{PyVarObject_HEAD_INIT(nullptr, 0)};

} // namespace

bool register_backward_node_type() {
  try {
    node_type.tp_getattro = getattro;
    node_type.tp_doc = "The backward node of a torch_opaque op call (Note [Backward node introspection]).";
    torch::autograd::_initFunctionPyTypeObject(node_type, "torch_opaque._C.OpaqueBackward",
                                               properties, methods);
    torch::autograd::registerCppFunction(detail::opaque_backward_type(), &node_type);
    return true;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return false;
  }
}

} // namespace torch_opaque::python
