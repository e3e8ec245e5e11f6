"""The Autocast-key kernels of each overload of a Function: under
``torch.autocast`` a call runs the op's autocast variant with the state it was
made under (Note [Autocast in the call] in torch_opaque/_impl/autocast_variant.py,
which defines the variants)."""

from __future__ import annotations

import functools

import torch

from .._impl.autocast_variant import _KEYS, call_state, variant_of


def register(overload) -> None:
    """The Autocast-key kernels of one overload of a Function (not of a variant)."""
    fn = overload.fn
    lib = fn.lib
    if getattr(fn, "autocast_base", None) is not None or not _KEYS:
        return
    op = overload.op
    qualified = f"{fn.name}.{overload.name}" if overload.overload else fn.name
    # an in-place op returns the Function's other outputs (Note [In-place Functions])
    dirty_outputs = {k for k, _ in overload.dirty}

    def kernel(*args, **kwargs):
        state = call_state(args)
        with torch._C._ExcludeDispatchKeyGuard(_excluded()):
            if state is None:  # autocast on, but for none of the call's devices
                return op(*args, **kwargs)
            values = list(args) + [kwargs[a.name] for a in op._schema.arguments[len(args):]
                                   if a.name in kwargs]
            result = variant_of(fn).apply(*values, state)
        if dirty_outputs:
            outs = result if isinstance(result, (tuple, list)) else (result,)
            result = [r for k, r in enumerate(outs) if k not in dirty_outputs]
        if not op._schema.returns:
            return None
        if len(op._schema.returns) > 1:
            return tuple(result)
        return result[0] if isinstance(result, (tuple, list)) else result

    for key in _KEYS.values():
        lib.impl(qualified, kernel, key)
        dispatch_key = getattr(torch._C.DispatchKey, key)
        op.py_kernels.pop(dispatch_key, None)
        op.py_impl(dispatch_key)(kernel)  # the Python dispatcher's (AOTAutograd tracing)


@functools.lru_cache(maxsize=None)
def _excluded():
    """The Autocast keys of every device autocast knows, as one DispatchKeySet."""
    keys = [torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, k)) for k in _KEYS.values()]
    return functools.reduce(lambda a, b: a | b, keys)
