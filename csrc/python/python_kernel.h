#pragma once
// Note [Python kernels]
// The kernels of an opaque op made from a Python autograd.Function run the
// user's forward and backward from C++: the bridge converts the stack to
// Python objects, builds the ctx (torch_opaque/context.py), calls the user's
// function, checks what it returned, and hands the result to the same
// finishers as ops written in C++ (Note [One forward finisher] in
// include/torch_opaque/detail/cpp_kernels.h), so saved-tensor matching,
// output copies and the forward record exist once. The Python runner objects
// (torch_opaque/kernels.py) supply the callables and handle the rare paths
// (argument conversion, ctx attribute encoding, error messages); their
// __call__ is the traceable Python twin used by fake kernels and graph passes.
// Python exceptions propagate unchanged to the Python caller.

#include <torch_opaque/opaque_op.h>

#include <pybind11/pybind11.h>

namespace torch_opaque::python {

// The `_fwd` kernel (also the op's inference kernel) of kernels.Runner `runner`.
BoxedKernel make_python_forward(pybind11::object runner);

// The `_bwd` kernel of kernels.BackwardRunner `runner`.
BoxedKernel make_python_backward(pybind11::object runner);

} // namespace torch_opaque::python
