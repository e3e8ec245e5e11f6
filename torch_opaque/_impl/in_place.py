"""In-place Functions (``ctx.mark_dirty``).

Note [In-place Functions]: a Function whose forward calls ``ctx.mark_dirty``
is an op with a mutable schema, as ``torch.library.custom_op`` makes one for
``mutates_args``: ``ns::Name(Tensor(a!) x, ...) -> (the other outputs)``.
Calling ``torch.ops.ns.Name(x)`` modifies ``x``; ``Cls.apply(x)`` returns ``x``
itself in the place of each dirty output (``results``), as stock does, so the
result IS the input, with its version counter bumped, a leaf that requires
grad refused with autograd's error, a view's base rebased (CopySlices) and
gradients flowing through the op's backward to the argument's previous
history. torch.export and torch.compile functionalize the op
(``auto_functionalized_v2``) as any custom op that mutates its arguments.

The mechanism is in C++ (Note [In-place ops] in csrc/in_place.cpp): the
training forward ``Name_fwd`` stays functional, so this module runs the
user's forward on copies of the tensor arguments (``dirty_forward``; with
``setup_context``, ``dirty_setup_forward`` and ``dirty_setup``, which hands
setup_context the copies as its inputs) and the kernels of ``Name`` write the
new values back into the arguments.

Which output is which argument (``dirty_pairs``) is learned from any run of the
forward (real, primed first call, or fake) before the op is defined, and is a
property of the Function.
"""

from __future__ import annotations

import threading

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


def _copies(args) -> tuple:
    """(copies of the tensor arguments, their versions). Fresh copies at version
    0 (a clone's copy_ would count as a write), so a dirty output's version is
    the number of writes the forward made, which the op adds to the argument's
    (bump_as_stock in csrc/in_place.cpp)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    return copies, [c._version if isinstance(c, torch.Tensor) else None for c in copies]


def dirty_forward(fn, forward):
    """``forward(ctx, ...)`` run on copies of its tensor arguments, recording
    which returned tensors were marked dirty (Note [In-place Functions])."""

    def forward_in_place(ctx, *args):
        copies, versions = _copies(args)
        dirty = []
        ctx.mark_dirty = lambda *ts: dirty.extend(ts)
        try:
            out = forward(ctx, *copies)
        finally:
            del ctx.mark_dirty
        _learn_pairs(fn, copies, versions, dirty, out)
        return out

    forward_in_place.__wrapped__ = forward
    return forward_in_place


# The copies a setup-style forward ran on, per thread, until its setup_context
# runs (last in, first out: a forward may call other Functions).
_SETUP_PENDING = threading.local()


def dirty_setup_forward(forward):
    """A setup-style ``forward(...)`` run on copies of its tensor arguments,
    which ``dirty_setup`` hands to setup_context in place of the arguments."""

    def forward_in_place(*args):
        copies, versions = _copies(args)
        stack = _SETUP_PENDING.__dict__.setdefault("stack", [])
        stack.append((copies, versions))
        try:
            return forward(*copies)
        except BaseException:
            stack.pop()
            raise

    forward_in_place.__wrapped__ = forward
    return forward_in_place


def dirty_setup(fn, setup):
    """``setup_context(ctx, inputs, output)`` given the copies the forward ran
    on as ``inputs``, recording which outputs were marked dirty."""

    def setup_in_place(ctx, inputs, output):
        copies, versions = _SETUP_PENDING.stack.pop()
        dirty = []
        ctx.mark_dirty = lambda *ts: dirty.extend(ts)
        try:
            setup(ctx, tuple(copies), output)
        finally:
            del ctx.mark_dirty
        _learn_pairs(fn, copies, versions, dirty, output)

    setup_in_place.__wrapped__ = setup
    return setup_in_place


def _learn_pairs(fn, copies, versions, dirty, out) -> None:
    """``fn.dirty_pairs`` from the tensors marked dirty, or a clear error."""
    name = fn.display_name
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


def _arg_name(fn, i: int) -> str:
    return f"arg{i}" if fn.varargs or i >= len(fn.arg_names) else fn.arg_names[i]


def dirty_pairs(fn, specs) -> tuple:
    """``((output, argument), ...)`` of the op being defined for ``specs``."""
    pairs = fn.dirty_pairs
    if pairs is None:
        raise RuntimeError(
            f"torch_opaque: {fn.display_name}: the op of an in-place Function is defined "
            f"before its forward ran (internal error)."
        )
    for _, i in pairs:
        if not specs[i].is_tensor:
            raise UnsupportedError(
                f"torch_opaque: {fn.display_name}: ctx.mark_dirty() marks argument "
                f"'{specs[i].name}', which is not a Tensor argument of the op. Mark only "
                f"Tensor arguments dirty, or keep this Function unwrapped."
            )
    return tuple(pairs)


def place_arguments(dirty, n_out: int, args, rest) -> list:
    """The Function's outputs: ``args[i]`` in the place of each dirty output
    ``k``, the op's other outputs ``rest`` in order around them."""
    by_output = dict(dirty)
    others = iter(rest)
    return [args[by_output[k]] if k in by_output else next(others) for k in range(n_out)]


def results(ov, args, out):
    """What ``Cls.apply`` returns for the in-place op's result ``out``."""
    n_rest = ov.n_out - len(ov.dirty)
    rest = () if n_rest == 0 else out if n_rest > 1 else (out,)
    outs = place_arguments(ov.dirty, ov.n_out, args, rest)
    return tuple(outs) if ov.returns_tuple else outs[0]
