#pragma once
// Note [Direct op call]
// `torch.ops.ns.Name.overload(...)` is what `ep.module()` and traced graphs run
// eagerly. OpOverload.__call__ forwards to its `_op`, torch's generic JIT
// entry point (pybind11 dispatch, overload matching, a schema walk that
// converts every argument, the GIL released and taken back). For the ops a
// wrapped Function defines, Python replaces `_op` with an OpCall: a C-level
// callable that converts arguments of the plain kinds (Tensor, Tensor?, float,
// int, SymInt, bool, str; positional or by keyword, with the schema's
// defaults) by the schema it already knows and calls the operator through the
// dispatcher, so autograd, functorch, Python dispatch modes and fake tensors
// see the call exactly as before. Anything else (another argument type or a
// value of a different Python type, tensors with __torch_function__, an
// active torch function mode, the JIT tracer) goes to the original `_op`
// unchanged, so errors and conversions stay torch's. hash(), attributes and
// repr() are the original's, as OpOverload hashes its `_op` and torch keeps
// overloads in sets.

#include <Python.h>

namespace torch_opaque::python {

// Adds the OpCall type to module `m`; returns false with a Python error set.
bool add_op_call_type(PyObject* m);

} // namespace torch_opaque::python
