"""The kernels of an op defined in C++ (``TORCH_OPAQUE_DEF``,
include/torch_opaque/op.h) run from Python, below autograd, so that tracing
sees the ATen ops they are made of (Note [Kernels below autograd] in
csrc/python/kernel_below_autograd.h): what :class:`~.tracing.ForwardTrace` and
:class:`~.tracing.BackwardTrace` call for ops that have no Python Function,
as ``kernels.Runner`` / ``kernels.BackwardRunner`` are for those that do.

Example (``example::scaled_sin`` of examples/cpp, built by scripts/dev.sh)::

    >>> import torch, torch_opaque
    >>> from torch_opaque._impl.cpp_kernels import CppBackward, CppRunner
    >>> torch_opaque.load_library("build/examples_cpp/libexample_ops.so")  # in a checkout
    >>> x = torch.tensor([0.0, 1.0])
    >>> outs, residuals, record = CppRunner("example", "scaled_sin", "default").run([True, False], [x, 3.0])
    >>> torch.allclose(outs[0], x.sin() * 3.0), residuals, record[0]  # x is saved: input 0
    (True, [], [1, 0, 0])
    >>> grads = CppBackward("example", "scaled_sin", "default")([x], [torch.ones(2)], [True, False], record[3], record[4])
    >>> torch.allclose(grads[0], x.cos() * 3.0), grads[1]
    (True, None)
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from .._native import _C
from . import autocast_variant
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
        # An autocast variant (Note [Autocast in the call: C++ ops]): its C++
        # forward enters the state in at::autocast's thread-local state, which
        # torch.export's pre-dispatch tracing does not see; entered here too,
        # torch.autocast records it in the traced program.
        args = schema.arguments
        self.autocast_state = (name.endswith(autocast_variant.SUFFIX) and len(args) >= 2
                               and args[-2].name == autocast_variant.STATE_ARG)

    def run(self, needs: Optional[Sequence[bool]], args: Sequence) -> tuple:
        needs = None if needs is None else [bool(n) for n in needs]
        state = autocast_variant.entered(args[-1]) if self.autocast_state else nullcontext()
        with state:
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
