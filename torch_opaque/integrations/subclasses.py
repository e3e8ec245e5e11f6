"""The op family on tensor subclasses that hold other tensors (jagged NestedTensor).

Note [Ops on wrapper subclasses]
A stock Function's forward runs on whatever tensors it is given: on a jagged
``NestedTensor`` (``torch.nested.nested_tensor(..., layout=torch.jagged)``)
its body is made of ops the subclass's ``__torch_dispatch__`` knows. The op
hides that body: autograd records the op's node as for any tensor, then
``Name_fwd`` reaches the subclass, which has no rule for it
(``NotImplementedError: opaque.Name_fwd.Tensor``). So each overload registers,
through ``torch.library.register_torch_dispatch`` (the supported hook for
rules between an operator and a subclass), rules for ``Name``, ``Name_fwd``
and ``Name_bwd`` that run the user's forward and backward on the subclass
tensors themselves, as stock runs them, through the same C++ bridge as the
real kernels (the forward's record goes to the op's backward node, which
autograd built above the subclass). The op stays one node of the autograd
graph. Example::

    >>> import torch, torch_opaque
    >>> @torch_opaque.op
    ... class Cube(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x ** 3
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 3 * x ** 2 * g
    >>> nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)],
    ...                                 layout=torch.jagged, requires_grad=True)
    >>> y = Cube.apply(nt)
    >>> y.values().sum().backward()
    >>> nt.grad.values().tolist()[0]
    [3.0, 3.0, 3.0]

Strided nested tensors (the C++ ``NestedTensorImpl``) are not subclasses:
they reach the op's kernel, whose body fails where stock's fails too (their
ops are a small set). In-place (``mark_dirty``) overloads get no rules.
"""

from __future__ import annotations

import torch

from .._impl.kernels import FakeRunner


def _subclasses() -> tuple:
    from torch.nested._internal.nested_tensor import NestedTensor

    return (NestedTensor,)


class SubclassRules:
    """The three rules of one overload (Note [Ops on wrapper subclasses])."""

    def __init__(self, ov):
        fn = ov.fn
        # The user's forward with its errors unchanged (a FakeRunner reads
        # needs_input_grad from `_fwd`'s arguments, runs with grad mode off
        # and hands the record to the C++ core, as the real kernel does).
        self.runner = FakeRunner(
            ov.runner.fn_name, fn.forward, fn.setup, ov.specs, ov.n_out, has_user_fake=True
        )
        self.bwd_runner = ov.bwd_runner

    def main(self, cls, func, types, args, kwargs):
        outs = self.runner(*args, **(kwargs or {}))[:-1]
        return outs[0] if len(outs) == 1 else outs

    def forward(self, cls, func, types, args, kwargs):
        return self.runner(*args, **(kwargs or {}))

    def backward(self, cls, func, types, args, kwargs):
        return list(self.bwd_runner(*args, **(kwargs or {}))[0])

    def register(self, ov, lib) -> None:
        if ov.dirty:  # (in-place ops: the subclass's own error)
            return
        for sub in _subclasses():
            torch.library.register_torch_dispatch(ov.op, sub, self.main, lib=lib)
            torch.library.register_torch_dispatch(ov.fwd_op, sub, self.forward, lib=lib)
            torch.library.register_torch_dispatch(ov.bwd_op, sub, self.backward, lib=lib)


def register(overload) -> None:
    """The wrapper-subclass rules of a new overload (Note [Ops on wrapper subclasses])."""
    SubclassRules(overload).register(overload, overload.fn.lib)
