#include "context_types.h"

#include "module_types.h"

#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>

namespace torch_opaque::python {
namespace {

PyObject* empty_tuple() {
  static PyObject* t = PyTuple_New(0);
  Py_INCREF(t);
  return t;
}

// Raises torch_opaque.errors.UnsupportedError(message); returns nullptr.
PyObject* raise_unsupported(PyObject* message) {
  PyObject* mod = PyImport_ImportModule("torch_opaque.errors");
  if (!mod) return nullptr;
  PyObject* cls = PyObject_GetAttrString(mod, "UnsupportedError");
  Py_DECREF(mod);
  if (!cls) return nullptr;
  PyErr_SetObject(cls, message);
  Py_DECREF(cls);
  return nullptr;
}

// ---- ForwardContext ------------------------------------------------------------

struct ForwardContext {
  PyObject_HEAD
  PyObject* dict;
  PyObject* fn_name;
  PyObject* needs_input_grad;
  PyObject* to_save;   // tuple
  PyObject* non_diff;  // tuple
  PyObject* materialize;  // Py_True / Py_False
};

PyTypeObject ForwardContextType = {PyVarObject_HEAD_INIT(nullptr, 0)};

ForwardContext* alloc_forward(PyTypeObject* type) {
  auto* self = reinterpret_cast<ForwardContext*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->to_save = empty_tuple();
  self->non_diff = empty_tuple();
  Py_INCREF(Py_True);
  self->materialize = Py_True;
  return self;
}

PyObject* forward_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject *fn_name, *needs;
  static const char* kw[] = {"fn_name", "needs_input_grad", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", const_cast<char**>(kw), &fn_name,
                                   &needs)) {
    return nullptr;
  }
  ForwardContext* self = alloc_forward(type);
  if (!self) return nullptr;
  Py_INCREF(fn_name);
  self->fn_name = fn_name;
  Py_INCREF(needs);
  self->needs_input_grad = needs;
  return reinterpret_cast<PyObject*>(self);
}

int forward_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  Py_VISIT(self->dict);
  Py_VISIT(self->fn_name);
  Py_VISIT(self->needs_input_grad);
  Py_VISIT(self->to_save);
  Py_VISIT(self->non_diff);
  return 0;
}

int forward_clear(PyObject* o) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  Py_CLEAR(self->dict);
  Py_CLEAR(self->fn_name);
  Py_CLEAR(self->needs_input_grad);
  Py_CLEAR(self->to_save);
  Py_CLEAR(self->non_diff);
  Py_CLEAR(self->materialize);
  return 0;
}

void forward_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  forward_clear(o);
  Py_TYPE(o)->tp_free(o);
}

PyObject* save_for_backward(PyObject* o, PyObject* tensors) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  const Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyTuple_GET_ITEM(tensors, i);
    if (t != Py_None && !THPVariable_Check(t)) {
      PyObject* msg = PyUnicode_FromFormat(
          "%S: save_for_backward can only save tensors or None, but argument %zd is a %s. "
          "Store other values as ctx attributes (ctx.name = value).",
          self->fn_name, i, Py_TYPE(t)->tp_name);
      if (!msg) return nullptr;
      raise_unsupported(msg);
      Py_DECREF(msg);
      return nullptr;
    }
  }
  Py_INCREF(tensors);
  Py_SETREF(self->to_save, tensors);
  Py_RETURN_NONE;
}

PyObject* save_for_forward(PyObject*, PyObject*) {
  // Only jvp reads these; opaque ops carry reverse-mode AD only, and
  // forward-mode AD through them fails with a clear error (Autograd kernel).
  Py_RETURN_NONE;
}

PyObject* mark_non_differentiable(PyObject* o, PyObject* tensors) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  PyObject* joined = PySequence_Concat(self->non_diff, tensors);
  if (!joined) return nullptr;
  Py_SETREF(self->non_diff, joined);
  Py_RETURN_NONE;
}

PyObject* set_materialize_grads(PyObject* o, PyObject* value) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  const int truth = PyObject_IsTrue(value);
  if (truth < 0) return nullptr;
  PyObject* b = truth ? Py_True : Py_False;
  Py_INCREF(b);
  Py_SETREF(self->materialize, b);
  Py_RETURN_NONE;
}

PyObject* mark_dirty(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<ForwardContext*>(o);
  PyObject* msg = PyUnicode_FromFormat(
      "%S: ctx.mark_dirty() was called from code other than the Function's own forward "
      "(a helper it calls); torch_opaque recognises in-place Functions by a "
      "ctx.mark_dirty call in forward itself (Note [In-place Functions]). Call "
      "ctx.mark_dirty in forward, or keep this Function unwrapped.",
      self->fn_name);
  if (!msg) return nullptr;
  raise_unsupported(msg);
  Py_DECREF(msg);
  return nullptr;
}

PyObject* forward_saved_tensors(PyObject* o, void*) {
  PyObject* t = reinterpret_cast<ForwardContext*>(o)->to_save;
  Py_INCREF(t);
  return t;
}

PyMethodDef forward_methods[] = {
    {"save_for_backward", save_for_backward, METH_VARARGS,
     "Save tensors (or None) for the backward: inputs and outputs by reference, "
     "others as residuals of the `_fwd` op."},
    {"save_for_forward", save_for_forward, METH_VARARGS,
     "Accepted and ignored: opaque ops carry reverse-mode gradients only."},
    {"mark_non_differentiable", mark_non_differentiable, METH_VARARGS,
     "Mark outputs as not requiring grad."},
    {"set_materialize_grads", set_materialize_grads, METH_O,
     "Whether undefined output gradients reach the backward as zeros (default) or None."},
    {"mark_dirty", mark_dirty, METH_VARARGS, "Refused here: in-place Functions are recognised from their forward's code."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef forward_members[] = {
    {"needs_input_grad", T_OBJECT, offsetof(ForwardContext, needs_input_grad), 0,
     "per forward argument: whether its gradient is needed"},
    {"_fn_name", T_OBJECT, offsetof(ForwardContext, fn_name), READONLY, nullptr},
    {"_to_save", T_OBJECT, offsetof(ForwardContext, to_save), READONLY, nullptr},
    {"_non_diff", T_OBJECT, offsetof(ForwardContext, non_diff), READONLY, nullptr},
    {"_materialize", T_OBJECT, offsetof(ForwardContext, materialize), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef forward_getset[] = {
    {"saved_tensors", forward_saved_tensors, nullptr, "the tensors saved so far", nullptr},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// ---- BackwardContext -----------------------------------------------------------

struct BackwardContext {
  PyObject_HEAD
  PyObject* dict;
  PyObject* fn_name;
  PyObject* saved_tensors;
  PyObject* needs_input_grad;
};

PyTypeObject BackwardContextType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* make_backward(PyTypeObject* type, PyObject* fn_name, PyObject* saved,
                        PyObject* needs, PyObject* attrs) {
  auto* self = reinterpret_cast<BackwardContext*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  Py_INCREF(fn_name);
  self->fn_name = fn_name;
  Py_INCREF(saved);
  self->saved_tensors = saved;
  Py_INCREF(needs);
  self->needs_input_grad = needs;
  if (attrs != Py_None && PyDict_Check(attrs)) {
    Py_INCREF(attrs);
    self->dict = attrs;
  }
  return reinterpret_cast<PyObject*>(self);
}

PyObject* backward_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject *fn_name, *saved, *needs, *attrs = Py_None;
  static const char* kw[] = {"fn_name", "saved_tensors", "needs_input_grad", "attrs", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O", const_cast<char**>(kw), &fn_name,
                                   &saved, &needs, &attrs)) {
    return nullptr;
  }
  return make_backward(type, fn_name, saved, needs, attrs);
}

int backward_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<BackwardContext*>(o);
  Py_VISIT(self->dict);
  Py_VISIT(self->fn_name);
  Py_VISIT(self->saved_tensors);
  Py_VISIT(self->needs_input_grad);
  return 0;
}

int backward_clear(PyObject* o) {
  auto* self = reinterpret_cast<BackwardContext*>(o);
  Py_CLEAR(self->dict);
  Py_CLEAR(self->fn_name);
  Py_CLEAR(self->saved_tensors);
  Py_CLEAR(self->needs_input_grad);
  return 0;
}

void backward_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  backward_clear(o);
  Py_TYPE(o)->tp_free(o);
}

PyObject* backward_saved_variables(PyObject* o, void*) {
  PyObject* t = reinterpret_cast<BackwardContext*>(o)->saved_tensors;
  Py_INCREF(t);
  return t;
}

PyMemberDef backward_members[] = {
    {"saved_tensors", T_OBJECT, offsetof(BackwardContext, saved_tensors), 0,
     "the tensors the forward saved"},
    {"needs_input_grad", T_OBJECT, offsetof(BackwardContext, needs_input_grad), 0,
     "per forward argument: whether its gradient is needed"},
    {"_fn_name", T_OBJECT, offsetof(BackwardContext, fn_name), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef backward_getset[] = {
    {"saved_variables", backward_saved_variables, nullptr, "alias of saved_tensors", nullptr},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

} // namespace

bool add_context_types(PyObject* m) {
  auto& f = ForwardContextType;
  f.tp_name = "torch_opaque._impl.context.ForwardContext";
  f.tp_basicsize = sizeof(ForwardContext);
  f.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  f.tp_doc =
      "ForwardContext(fn_name, needs_input_grad): `ctx` inside a wrapped forward (or "
      "setup_context). Behaves like autograd.Function's ctx for everything an opaque op can "
      "carry (Note [Context state] in torch_opaque/_impl/context.py).";
  f.tp_new = forward_new;
  f.tp_dealloc = forward_dealloc;
  f.tp_traverse = forward_traverse;
  f.tp_clear = forward_clear;
  f.tp_methods = forward_methods;
  f.tp_members = forward_members;
  f.tp_getset = forward_getset;
  f.tp_dictoffset = offsetof(ForwardContext, dict);

  auto& b = BackwardContextType;
  b.tp_name = "torch_opaque._impl.context.BackwardContext";
  b.tp_basicsize = sizeof(BackwardContext);
  b.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  b.tp_doc =
      "BackwardContext(fn_name, saved_tensors, needs_input_grad, attrs=None): `ctx` inside "
      "a wrapped backward: saved tensors, needs_input_grad and the attributes the forward "
      "set.";
  b.tp_new = backward_new;
  b.tp_dealloc = backward_dealloc;
  b.tp_traverse = backward_traverse;
  b.tp_clear = backward_clear;
  b.tp_members = backward_members;
  b.tp_getset = backward_getset;
  b.tp_dictoffset = offsetof(BackwardContext, dict);
  return add_type(m, &f, "ForwardContext") && add_type(m, &b, "BackwardContext");
}

PyObject* new_forward_context(PyObject* fn_name, PyObject* needs_input_grad) {
  ForwardContext* self = alloc_forward(&ForwardContextType);
  if (!self) return nullptr;
  Py_INCREF(fn_name);
  self->fn_name = fn_name;
  Py_INCREF(needs_input_grad);
  self->needs_input_grad = needs_input_grad;
  return reinterpret_cast<PyObject*>(self);
}

ForwardContextView view_forward_context(PyObject* ctx) {
  auto* self = reinterpret_cast<ForwardContext*>(ctx);
  return {self->to_save, self->non_diff, self->materialize == Py_True,
          self->dict != nullptr && PyDict_GET_SIZE(self->dict) > 0, self->dict};
}

PyObject* new_backward_context(PyObject* fn_name, PyObject* saved_tensors,
                               PyObject* needs_input_grad, PyObject* attrs) {
  return make_backward(&BackwardContextType, fn_name, saved_tensors, needs_input_grad, attrs);
}

} // namespace torch_opaque::python
