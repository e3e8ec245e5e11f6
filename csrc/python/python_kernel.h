#pragma once
// Note [Python kernels]
// The kernels of an opaque op made from a Python autograd.Function run the
// user's forward and backward from C++: the bridge converts the stack to
// Python objects, builds the ctx (Note [ctx types]), calls the user's
// function, checks what it returned, and hands the result to the same
// finishers as ops written in C++ (Note [One forward finisher] in
// include/torch_opaque/detail/finishers.h), so saved-tensor matching,
// output copies and the forward record exist once. The Python runner objects
// (torch_opaque/_impl/kernels.py, torch_opaque/archive/stored.py) supply the
// callables and handle the rare paths (argument conversion, ctx attribute
// encoding, error messages); what the bridge reads from them is written down
// in torch_opaque/_impl/bridge.py (ForwardRunnerProtocol, BackwardRunnerProtocol). Python code
// that traces a forward or backward (fake kernels, graph passes, stored
// programs) runs it through the same code with run_forward_from_python /
// run_backward_from_python. Python exceptions propagate unchanged.

#include <torch_opaque/opaque_op.h>

#include <pybind11/pybind11.h>

#include <c10/core/SymInt.h>

#include <string>
#include <vector>

namespace torch_opaque::python {

// The `_fwd` kernel (also the op's inference kernel) of kernels.Runner `runner`.
BoxedKernel make_python_forward(pybind11::object runner);

// The `_bwd` kernel of kernels.BackwardRunner `runner` (Note [Direct backward]
// in opaque_op.h).
DirectBackward make_python_backward(pybind11::object runner);

// The same forward for Python callers that trace it (fake kernels, graph
// passes, stored programs): `forward` / `setup` replace the runner's (e.g. to
// translate errors); `needs` is a sequence of bools or None (not recorded).
// Returns (outputs, residuals, record), record being None or the arguments
// of torch_opaque._C.set_forward_record. Grad mode is left as it is.
pybind11::tuple run_forward_from_python(pybind11::object runner, pybind11::object forward,
                                        pybind11::object setup, pybind11::object needs,
                                        pybind11::tuple args);

// Note [First call runs forward once]: the user's forward of kernels.Runner
// `runner` run as the kernel runs it (grad mode off, the in-place check) while
// the op's number of outputs is still unknown: no conversion, no output
// checks, no record. `needs` is a tuple of bools. Returns (what forward
// returned, the ctx), to hand to set_primed.
pybind11::tuple run_first_forward_from_python(pybind11::object runner, pybind11::object needs,
                                              pybind11::tuple args);

// The same backward for Python callers: the list of gradients (None where none).
pybind11::list run_backward_from_python(pybind11::object runner, pybind11::object backward,
                                        pybind11::object saved, pybind11::object grads,
                                        pybind11::object needs, std::string state,
                                        std::vector<c10::SymInt> state_ints);

// Note [First call runs forward once] (python_kernel.cpp): the next forward
// kernel of `runner` on this thread uses (out, ctx) instead of calling the
// forward, if its needs_input_grad equals ctx.needs_input_grad. A None
// runner clears the slot.
void set_primed(pybind11::object runner, pybind11::object out, pybind11::object ctx);

// The ctx attribute dict a Python forward left, kept as objects (Note [Eager
// context state]), when `state` is that of a Python Function; else nullptr.
// Borrowed.
PyObject* eager_ctx_attributes(const EagerState* state);

} // namespace torch_opaque::python
