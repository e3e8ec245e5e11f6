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

// Whether `o` takes part in __torch_function__ dispatch, as torch decides it:
// exact Tensors and plain Python scalars never do; other objects do when
// their type has a __torch_function__ other than the disabled one (which
// torch.nn.Parameter uses).
bool may_override(PyObject* o);

// Adds the DirectApply type to module `m`; returns false with a Python error set.
bool add_direct_apply_type(PyObject* m);

} // namespace torch_opaque::python
