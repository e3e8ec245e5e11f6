#pragma once
// Note [Python kernels]
// A BoxedKernel that calls a Python callable: stack values become Python
// objects (ScalarType arguments become torch.dtype), the callable returns a
// tuple with one item per schema return, converted back by the return types.
// Python exceptions propagate unchanged to the Python caller.

#include <torch_opaque/opaque_op.h>

#include <pybind11/pybind11.h>

namespace torch_opaque::python {

BoxedKernel make_python_kernel(pybind11::object fn);

} // namespace torch_opaque::python
