#pragma once
// Note [Python kernels]
// A BoxedKernel that calls a Python callable: stack values become Python
// objects (ScalarType arguments become torch.dtype), the callable returns a
// tuple with one item per schema return, converted back by the return types.
// Python exceptions propagate unchanged to the Python caller.

#include <torch_opaque/opaque_op.h>

#include <pybind11/pybind11.h>

namespace torch_opaque::python {

// Which kernel of an opaque op the callable is.
enum class KernelRole {
  // `_fwd`: called as fn(needs_input_grad or None, *args); returns the
  // schema's returns followed by the forward record (None, or the arguments
  // of set_forward_record as a tuple), which the bridge reports.
  Forward,
  // `_bwd`: list arguments arrive as tuples.
  Backward,
};

BoxedKernel make_python_kernel(pybind11::object fn, KernelRole role);

} // namespace torch_opaque::python
