"""What every Python caller that traces an opaque call needs, once: a size for
a symbolic dimension, real-shaped stand-ins for traced values, a plain
sample of a torch.func-wrapped tensor, and copies of outputs that alias inputs.

Used by the first-call probe (function.py), auto() (hooks/auto.py), graph
passes, stored programs (archive/) and ONNX export.
"""

from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch

# The size given to a symbolic dimension whose hint is unknown (an unbacked
# size, or one the shape environment cannot evaluate). Not 0 or 1, which
# torch.export specializes, and not 2, the smallest size it keeps symbolic, so
# that it is unlikely to equal a static size by accident.
FALLBACK_SIZE_HINT = 4


def size_hint(v: Any) -> int:
    """An int for a size: the size itself, its hint, or one that satisfies the
    symbol's range where the shape environment knows it."""
    if not isinstance(v, torch.SymInt):
        return int(v)
    node = v.node
    h = getattr(node, "hint", None)
    if h is not None:
        return int(h)
    env = getattr(node, "shape_env", None)
    if env is not None:
        try:
            h = env.size_hint(node.expr, allow_none=True)
        except Exception:  # the shape environment's own evaluation errors
            h = None
        if h is not None:
            return int(h)
        subs = {}
        for s in node.expr.free_symbols:
            vr = env.var_to_range.get(s)
            # (torch's infinite bounds, int_oo, say they are finite: ask for an Integer)
            lo = int(vr.lower) if vr is not None and isinstance(vr.lower, sympy.Integer) else 2
            subs[s] = max(lo, 2)  # 2: the smallest size torch.export keeps symbolic
        try:
            return int(node.expr.xreplace(subs))
        except Exception:  # an expression that does not reduce to a number
            pass
    return FALLBACK_SIZE_HINT


def real_shaped(v: Any) -> Any:
    """``v`` with symbolic sizes replaced by their hints: tensors become empty
    tensors of the hinted shape and strides (made in the current mode),
    sequences are converted item by item, SymInts become ints."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(
            [size_hint(s) for s in v.shape],
            [size_hint(s) for s in v.stride()],
            dtype=v.dtype,
            device=v.device,
        )
    if isinstance(v, torch.Size):
        return torch.Size(size_hint(x) for x in v)
    if isinstance(v, (list, tuple)):
        return type(v)(real_shaped(x) for x in v)
    if isinstance(v, torch.SymInt):
        return size_hint(v)
    return v


def one_plain_sample(v: Any) -> Any:
    """A torch.func (vmap, grad, jvp) wrapped tensor's plain tensor (one sample
    of a vmapped one): the output probe of a first call inside a transform runs on it."""
    F = torch._C._functorch
    while isinstance(v, torch.Tensor) and F.is_functorch_wrapped_tensor(v):
        if F.is_batchedtensor(v):  # one sample
            v = F.get_unwrapped(v).select(F.maybe_get_bdim(v), 0)
        else:
            v = F.get_unwrapped(v)
    return v


def unalias(outs: Sequence, inputs: Sequence) -> tuple:
    """Operator outputs may not alias inputs or each other: a copy of each that
    shares storage with an input or an earlier output (views included), as the
    C++ finishers make for the real kernels (Note [One forward finisher] in
    include/torch_opaque/detail/finishers.h)."""
    fixed = None
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            continue
        if any(isinstance(x, torch.Tensor) and torch._C._is_alias_of(o, x) for x in inputs) or any(
            isinstance(x, torch.Tensor) and torch._C._is_alias_of(o, x) for x in outs[:k]
        ):
            if fixed is None:
                fixed = list(outs)
            fixed[k] = o.clone()
    return tuple(outs) if fixed is None else tuple(fixed)
