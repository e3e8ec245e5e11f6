"""In-place Functions (``ctx.mark_dirty``).

Note [In-place Functions]: the op of a Function whose forward calls
``ctx.mark_dirty`` stays functional: its kernel runs the user's forward on
copies of the tensor arguments, so the op's outputs never alias its inputs and
every graph (export, compile, joint graphs) treats it like any other op. The
caller (``OpaqueFunction.apply`` eagerly, the Dynamo hook while tracing) then
writes each returned dirty tensor back into the argument it came from with
``arg.copy_(out)`` and returns the argument object itself. That gives stock
semantics: the result IS the input, its version counter is bumped, a leaf that
requires grad is refused by autograd's in-place check, a view of another tensor
gets its base's history rebased (CopySlices), and gradients flow through the
op's backward to the argument's previous history. Export functionalizes the
write-back as an input mutation.

Which output is which argument (``dirty_pairs``) is learned from any run of the
forward (real, primed first call, or fake) and is a property of the Function.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .bridge import modified_input_error


def uses_mark_dirty(cls) -> bool:
    """Whether ``cls.forward`` (or its ``setup_context``) calls ``ctx.mark_dirty``."""
    for name in ("forward", "setup_context"):
        code = getattr(getattr(cls, name, None), "__code__", None)
        if code is not None and "mark_dirty" in code.co_names:
            return True
    return False


def check_supported(fn) -> None:
    """Refuse the in-place forms that an op cannot carry (at wrap time)."""
    if fn.setup_style:
        raise UnsupportedError(
            f"torch_opaque: {fn.display_name}: ctx.mark_dirty() in a Function with "
            f"setup_context is not supported (the forward cannot be run on copies of "
            f"its arguments). Use the forward(ctx, ...) style, or keep this Function "
            f"unwrapped."
        )


def dirty_forward(fn, forward):
    """``forward`` run on copies of its tensor arguments, recording which
    returned tensors were marked dirty (Note [In-place Functions])."""
    name = fn.display_name

    def forward_in_place(ctx, *args):
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        versions = [c._version if isinstance(c, torch.Tensor) else None for c in copies]
        dirty = []
        ctx.mark_dirty = lambda *ts: dirty.extend(ts)
        try:
            out = forward(ctx, *copies)
        finally:
            del ctx.mark_dirty
        outs = out if isinstance(out, tuple) else (out,)
        pairs = []
        for t in dirty:
            i = next((i for i, c in enumerate(copies) if c is t), None)
            if i is None:
                raise UnsupportedError(
                    f"torch_opaque: {name}: ctx.mark_dirty() was given a tensor that is "
                    f"not one of forward's tensor arguments; an op can only mutate its "
                    f"arguments. Mark only arguments dirty, or keep this Function unwrapped."
                )
            k = next((k for k, o in enumerate(outs) if o is t), None)
            if k is None:
                raise UnsupportedError(
                    f"torch_opaque: {name}: the forward marked argument "
                    f"'{_arg_name(fn, i)}' dirty but does not return it. Return the "
                    f"modified argument (as autograd.Function expects of dirty tensors), "
                    f"or keep this Function unwrapped."
                )
            pairs.append((k, i))
        written = {i for _, i in pairs}
        for i, (c, v) in enumerate(zip(copies, versions)):
            if v is not None and i not in written and c._version != v:
                raise modified_input_error(name, _arg_name(fn, i))
        fn.dirty_pairs = tuple(pairs)
        return out

    forward_in_place.__wrapped__ = forward
    return forward_in_place


def _arg_name(fn, i: int) -> str:
    return f"arg{i}" if fn.varargs or i >= len(fn.arg_names) else fn.arg_names[i]


def write_back(fn, values, out):
    """Copy each dirty output into its argument and return the arguments in
    their place (eager calls and non-strict export)."""
    pairs = fn.dirty_pairs
    if not pairs:
        return out
    outs = list(out) if isinstance(out, tuple) else [out]
    for k, i in pairs:
        arg = values[i]
        arg.copy_(outs[k])
        outs[k] = arg
    return tuple(outs) if isinstance(out, tuple) else outs[0]
