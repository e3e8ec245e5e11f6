"""Forward-mode AD of a wrapped Function: the ``Name_jvp`` op.

Note [Forward-mode AD]
A Function that defines ``jvp`` gets one more op per overload,
``ns::Name_jvp(<forward arguments>, Tensor?[] tangents) -> (<outputs>, Tensor[])``:
it runs the forward (``forward`` / ``setup_context`` with a ctx whose
``save_for_forward`` tensors are the ``saved_tensors`` that ``jvp`` reads, as
in stock autograd.Function), then ``jvp(ctx, *tangents)``, and returns the
outputs and one tangent per output (zeros where ``jvp`` gave None). The
Autograd kernel (csrc/forward_ad.cpp) calls it when an argument carries a
forward gradient (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``
dual tensors) and sets the tangents on the outputs. Traced graphs keep it as
one node. When reverse mode is needed at the same time, the outputs come from
``Name_fwd`` (for the backward) and the forward runs a second time in
``Name_jvp``. A Function without ``jvp`` gets torch's own error.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError


class JvpContext:
    """The ctx of a forward run for ``jvp``: stock autograd.Function's methods."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self._for_forward = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        pass  # the backward's tensors come from `Name_fwd`

    def save_for_forward(self, *tensors):
        self._for_forward = tensors

    @property
    def saved_tensors(self):
        return self._for_forward

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value

    def mark_dirty(self, *args):
        raise UnsupportedError("torch_opaque: mark_dirty is not supported in a wrapped Function.")


def has_jvp(cls) -> bool:
    return cls.jvp is not torch.autograd.Function.jvp


def returns(n_out: int) -> str:
    return "(" + ", ".join(["Tensor"] * n_out + ["Tensor[]"]) + ")"


def define(overload, cls, lib, arguments: str) -> None:
    """Define and implement ``Name_jvp`` for one Overload (Note [Forward-mode AD])."""
    fn = overload.fn
    suffix = f".{overload.overload}" if overload.overload else ""
    sep = ", " if arguments else ""
    lib.define(f"{fn.name}_jvp{suffix}({arguments}{sep}Tensor?[] tangents) -> {returns(overload.n_out)}")
    jvp = cls.jvp
    kernel = _kernel(overload.runner, jvp)
    lib.impl(f"{fn.name}_jvp{suffix}", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(
        f"{fn.namespace}::{fn.name}_jvp{suffix}", _kernel(overload.fake_runner, jvp), lib=lib
    )
    overload.jvp_kernel = kernel
    overload.jvp_op = getattr(getattr(getattr(torch.ops, fn.namespace), fn.name + "_jvp"), overload.name)


def _kernel(runner, jvp):
    def kernel(*args):
        args, tangents = runner.convert_args(args[:-1]), args[-1]
        ctx = JvpContext((False,) * len(args))
        with torch.no_grad():
            outs = runner.outputs(runner.call_user(ctx, args))
            if ctx.materialize_grads:  # stock passes zeros for inputs without a tangent
                tangents = [
                    torch.zeros_like(a) if t is None and _differentiable(a) else t
                    for t, a in zip(tangents, args)
                ]
            res = jvp(ctx, *tangents)
        if not isinstance(res, tuple):
            res = (res,)
        if len(res) != len(outs):
            raise RuntimeError(
                f"torch_opaque: {runner.fn_name}.jvp returned {len(res)} tangents for "
                f"{len(outs)} outputs. Return one tangent (or None) per output."
            )
        tangents_out = [
            torch.zeros_like(o) if t is None else (t.clone() if _aliases(t, (o, *args, *tangents)) else t)
            for t, o in zip(res, outs)
        ]
        return (*(o.clone() if _aliases(o, args) else o for o in outs), tangents_out)

    return kernel


def _differentiable(a) -> bool:
    return isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())


def _aliases(t, args) -> bool:
    return any(isinstance(a, torch.Tensor) and a is t for a in args)
