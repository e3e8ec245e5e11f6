#pragma once
// The Python type of an op call's backward node (Note [Backward node
// introspection] in csrc/autograd_kernel.h).

namespace torch_opaque::python {

// Registers the type with torch, once per process; false with a Python error
// set on failure.
bool register_backward_node_type();

} // namespace torch_opaque::python
