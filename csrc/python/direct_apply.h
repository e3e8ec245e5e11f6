#pragma once
// Note [Direct apply]
// `Cls.apply` of a wrapped Function is the hot path of eager code, and a
// Python-level apply (binding, a cache lookup, then torch.ops' generic
// argument parsing) costs more than the op itself on small tensors. A
// DirectApply object is a C-level callable installed as `Cls.apply` (through
// classmethod): when the call is positional and the argument types match an
// entry Python registered after a first, slow call, it converts the arguments
// by the overload's schema and calls the op through the dispatcher. Anything
// else (keywords, new types, a subclass of Cls, tensors with
// __torch_function__, an active torch function mode) goes to the Python
// fallback unchanged, so behaviour is the same on both paths.

#include <Python.h>

namespace torch_opaque::python {

// Adds the DirectApply type to module `m`; returns false with a Python error set.
bool add_direct_apply_type(PyObject* m);

} // namespace torch_opaque::python
