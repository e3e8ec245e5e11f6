#pragma once
// Note [ctx types]
// The `ctx` a wrapped Function's forward and backward receive
// (torch_opaque._impl.context.ForwardContext / BackwardContext) are C types, like
// autograd.Function's own ctx: building one and calling save_for_backward
// costs no Python frame, and the bridge reads what the forward left on it
// straight from the struct. User attributes live in the instance __dict__,
// which holds nothing else (and stays unallocated when none are set).

#include <Python.h>

namespace torch_opaque::python {

// Adds ForwardContext and BackwardContext to module `m`; false with a Python
// error set on failure.
bool add_context_types(PyObject* m);

// A new ForwardContext (new reference; needs_input_grad is a tuple of bools).
PyObject* new_forward_context(PyObject* fn_name, PyObject* needs_input_grad);

// What the forward left on a ForwardContext (borrowed references).
struct ForwardContextView {
  PyObject* to_save;   // tuple of tensors / None
  PyObject* non_diff;  // tuple of tensors
  bool materialize_grads;
  bool has_attributes;  // user attributes in __dict__
  PyObject* dict;       // the __dict__ (nullptr when never allocated)
};
ForwardContextView view_forward_context(PyObject* ctx);

// A new BackwardContext (new reference); attrs is a dict or None. The
// context uses `attrs` as its __dict__ (not a copy), as autograd.Function's
// ctx is one object for forward and backward.
PyObject* new_backward_context(PyObject* fn_name, PyObject* saved_tensors,
                               PyObject* needs_input_grad, PyObject* attrs);

} // namespace torch_opaque::python
