"""Routing Dynamo's handling of ``Cls.apply`` to the op of a wrapped class.

Note [Dynamo and wrapped classes]
Dynamo does not call ``Cls.apply`` for a torch.autograd.Function subclass: it
recognises the class and speculates forward/backward into its own higher-order
op (torch/_dynamo/variables/misc.py, AutogradFunctionVariable.call_apply).
For wrapped classes (and, inside ``torch_opaque.auto()``, every eligible
class) we replace that step: the argument trackers' example values pick the
overload (defining it if needed, outside the traced program), and the call is
emitted as a call of that OpOverload, so the graph holds one op node.
"""

from __future__ import annotations

import torch

_installed = False


def _example(vt):
    from torch._dynamo.variables import SymNodeVariable
    from torch._dynamo.variables.lists import BaseListVariable, SizeVariable, TupleVariable

    if vt.is_tensor():
        return vt.as_proxy().node.meta["example_value"]
    if isinstance(vt, SymNodeVariable):
        return vt.sym_num
    if isinstance(vt, SizeVariable):
        return torch.Size(_example(x) for x in vt.items)
    if isinstance(vt, BaseListVariable):
        items = [_example(x) for x in vt.items]
        return tuple(items) if isinstance(vt, TupleVariable) else items
    if vt.is_python_constant():
        return vt.as_python_constant()
    from .schema import SchemaError

    raise SchemaError(
        f"torch_opaque: cannot pass {vt.debug_repr() if hasattr(vt, 'debug_repr') else vt} "
        f"to an opaque op while tracing with Dynamo; pass tensors and plain values."
    )


def _call_op(fn, tx, args, kwargs):
    from torch._dynamo.variables import ConstantVariable, VariableTracker
    from torch._dynamo.variables.lists import TupleVariable

    if kwargs:
        bound = fn.signature.bind(*args, **kwargs)
        arg_vts = []
        for n in fn.arg_names:
            if n in bound.arguments:
                arg_vts.append(bound.arguments[n])
            else:
                arg_vts.append(ConstantVariable.create(fn.defaults[n]))
    else:
        arg_vts = list(args)
        for n in fn.arg_names[len(arg_vts) :]:
            if n not in fn.defaults:
                raise TypeError(f"{fn.display_name}.apply() missing argument '{n}'")
            arg_vts.append(VariableTracker.build(tx, fn.defaults[n]))
    ov = fn.overload_for([_example(vt) for vt in arg_vts])
    op_vt = VariableTracker.build(tx, ov.op)
    out = op_vt.call_function(tx, arg_vts, {})
    if ov.returns_tuple and ov.n_out == 1:
        out = TupleVariable([out])
    return out


def install() -> None:
    """Patch Dynamo once; a no-op when Dynamo's internals are not as expected."""
    global _installed
    if _installed:
        return
    try:
        from torch._dynamo.variables.misc import AutogradFunctionVariable
    except Exception:  # pragma: no cover - Dynamo unavailable
        return
    from . import auto_mode
    from .errors import SchemaError

    original = AutogradFunctionVariable.call_apply

    def call_apply(self, tx, args, kwargs):
        fn = auto_mode.routed(self.fn_cls)
        if fn is None:
            return original(self, tx, args, kwargs)
        try:
            return _call_op(fn, tx, args, kwargs)
        except SchemaError as e:
            if fn.explicit:
                raise
            auto_mode.warn_unwrapped(self.fn_cls, str(e))
            return original(self, tx, args, kwargs)

    AutogradFunctionVariable.call_apply = call_apply
    _installed = True
