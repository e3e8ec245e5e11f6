#pragma once
// Note [Kernels below autograd]
// Tracing a C++-defined op to ATen (self-contained archives, ONNX function
// bodies) runs the op's own `_fwd` / `_bwd` kernels on the traced values: the
// kernel is reached with OperatorHandle::redispatchBoxed on the backend of its
// tensor arguments, so the op itself is not dispatched (no Autograd kernel, no
// Python dispatch mode recording the op as one node), while every ATen call the
// kernel makes goes through the dispatcher as usual and is traced. A `_fwd`
// kernel given needs_input_grad leaves a forward record (Note [Forward record]);
// it is returned like run_forward_from_python's.

#include <torch_opaque/forward_record.h>

#include <pybind11/pybind11.h>

#include <string>

namespace torch_opaque::python {

// Calls `name.overload`'s kernel for the backend of its tensor arguments (CPU
// when it has none) with `args` (by position, bound to its schema). Returns
// (what the op returns, record or None).
pybind11::tuple call_kernel_below_autograd(const std::string& name, const std::string& overload,
                                           pybind11::tuple args);

// A forward record as the tuple torch_opaque._C.set_forward_record takes.
pybind11::tuple record_to_python(const ForwardRecord& record);

} // namespace torch_opaque::python
