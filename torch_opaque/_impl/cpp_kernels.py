"""The kernels of an op defined in C++ (``TORCH_OPAQUE_DEF``,
include/torch_opaque/op.h) run from Python, below autograd, so that tracing
sees the ATen ops they are made of (Note [Kernels below autograd] in
csrc/python/kernel_below_autograd.h): what :class:`~.tracing.ForwardTrace` and
:class:`~.tracing.BackwardTrace` call for ops that have no Python Function,
as ``kernels.Runner`` / ``kernels.BackwardRunner`` are for those that do.

Example (``example::scaled_sin`` from examples/cpp)::

    >>> import torch, torch_opaque
    >>> from torch_opaque._impl.cpp_kernels import CppRunner
    >>> runner = CppRunner("example", "scaled_sin", "default")  # doctest: +SKIP
    >>> outs, residuals, record = runner.run([True, False], [torch.zeros(2), 3.0])  # doctest: +SKIP
    >>> outs, record[3]  # doctest: +SKIP
    ((tensor([0., 0.]),), '...')
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _C
from .calls import CallSignature


class CppRunner:
    """``ns::Name_fwd.overload``'s kernel: ``run(needs, args)`` -> (outputs,
    residuals, record or None), like ``kernels.Runner.run``."""

    def __init__(self, namespace: str, name: str, overload: str):
        self.display_name = f"{namespace}::{name}"
        self.fwd_name = f"{namespace}::{name}_fwd"
        self.overload = "" if overload == "default" else overload
        schema = torch._C._get_schema(self.fwd_name, self.overload)
        self.signature = CallSignature.of_schema(schema)
        self.n_out = len(schema.returns) - 1  # without the residual list

    def run(self, needs: Optional[Sequence[bool]], args: Sequence) -> tuple:
        needs = None if needs is None else [bool(n) for n in needs]
        res, record = _C.call_kernel_below_autograd(
            self.fwd_name, self.overload, (*args, needs)
        )
        return tuple(res[: self.n_out]), list(res[self.n_out]), record


class CppBackward:
    """``ns::Name_bwd.overload``'s kernel, with ``_bwd``'s arguments: one
    gradient or None per forward argument."""

    def __init__(self, namespace: str, name: str, overload: str):
        self.bwd_name = f"{namespace}::{name}_bwd"
        self.overload = "" if overload == "default" else overload

    def __call__(self, saved, grads, needs_input_grad, state, state_ints) -> list:
        res, _ = _C.call_kernel_below_autograd(
            self.bwd_name, self.overload,
            (list(saved), list(grads), [bool(n) for n in needs_input_grad], state,
             list(state_ints)),
        )
        return list(res)
