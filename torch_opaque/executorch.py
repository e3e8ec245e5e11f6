"""Lowering programs that call opaque ops to ExecuTorch (``.pte`` files).

Note [Opaque ops in ExecuTorch]
ExecuTorch runs a program with kernels compiled into its C++ runtime, looked up
by the ``out`` variant of each op (``ns::Name.out``). An opaque op has none, so
``executorch.exir.to_edge_transform_and_lower(ep).to_executorch()`` refuses a
program that calls one ("Missing out variants: {'opaque::Name'}"), with or
without a partitioner. A Python Function's forward cannot run in that runtime
at all, and a C++ op (torch_opaque/op.h) would need its kernels rebuilt against
ExecuTorch's headers and linked into the runtime. So each opaque call is
replaced by its body before lowering: :func:`prepare` runs
:func:`torch_opaque.passes.inline` (the Function's forward, or a C++ op's own
kernels below autograd, traced to ATen ops; in a training program
(:func:`torch_opaque.export_training`) also each ``Name_bwd``: the custom
backward traced to ATen ops), and :func:`to_edge_transform_and_lower` hands the
result to ExecuTorch's own function of that name, with the caller's arguments,
returning ExecuTorch's ``EdgeProgramManager``. The rest of the program is left
as it was, so partitioners (XNNPACK) see it as they would without opaque ops.

ExecuTorch's hooks were weighed first: ``transform_passes=`` runs after the
program is in Edge dialect (the opaque calls are already there, and would have
to be retraced into Edge ops), ``EdgeCompileConfig`` only names ops to
preserve, and its decomposition table is built inside the call (not an
argument). A partitioner's ``transform_for_pre_decomposition`` runs early
enough, but a partitioner also chooses which ATen ops are decomposed: one that
only inlines (its ``ops_to_not_decompose`` empty) makes ExecuTorch decompose
with the full table what another partitioner asks to keep, in either order
(XNNPACK then gets ``aten.linear`` as ``permute_copy`` + ``addmm``). A
CompositeImplicitAutograd kernel would make ExecuTorch decompose the op, but it
would do so for every trace in the process (torch.export and torch.compile
would no longer keep the op). Hence a wrapper.

A body that is not made of ATen ops (a C++ kernel looping over ``data_ptr``, a
forward that calls numpy) cannot be traced: :class:`ExecuTorchLoweringError`
names the op and the reason. Gradients of an inlined *inference* program come
from ATen's autograd, not from the custom backward; a training program keeps
the custom backward, traced.

Example (a Python Function, lowered and run in ExecuTorch's runtime)::

    >>> import torch, torch_opaque, torch_opaque.executorch
    >>> from executorch.runtime import Runtime
    >>> @torch_opaque.op(name="DocExecuTorchSTE")
    ... class RoundSTE(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x.round()
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return RoundSTE.apply(x * 4) / 4
    >>> x = torch.tensor([0.1, 0.3, 0.6])
    >>> ep = torch.export.export(Net(), (x,))
    >>> edge = torch_opaque.executorch.to_edge_transform_and_lower(ep)
    >>> pte = edge.to_executorch().buffer
    >>> method = Runtime.get().load_program(pte).load_method("forward")
    >>> method.execute([x])[0]
    tensor([0.0000, 0.2500, 0.5000])
"""

from __future__ import annotations

from typing import Any, Dict, Union

import torch

from . import passes
from .errors import TorchOpaqueError

__all__ = ["ExecuTorchLoweringError", "prepare", "to_edge_transform_and_lower"]


class ExecuTorchLoweringError(TorchOpaqueError, RuntimeError):
    """An opaque op whose body cannot be traced to ATen ops for ExecuTorch."""


def _culprit(ep, error: Exception) -> Exception:
    """The error of the first opaque op that fails to inline on its own, naming
    the op (``passes.inline`` of the whole program only says the retrace failed)."""
    seen = []
    for record in passes.list_opaque_ops(ep):
        qual = f"{record.qualified_name}.{record.overload}"
        if qual in seen:
            continue
        seen.append(qual)
        try:
            passes.inline(ep, ops=qual)
        except Exception as e:  # noqa: BLE001 - reported with the op's name
            where = record.defined_by or "defined in C++"
            why = str(e).split("\n\nWhile executing")[0]
            return ExecuTorchLoweringError(
                f"torch_opaque.executorch: cannot lower {qual} ({where}): ExecuTorch's runtime "
                f"has no kernel for an opaque op, so its body is inlined as ATen ops, and "
                f"tracing it failed: {why}\nWrite its forward (and backward) with torch/ATen "
                f"operations, or replace the op before lowering "
                f"(torch_opaque.passes.replace(ep, {qual!r}, fn))."
            )
    return ExecuTorchLoweringError(f"torch_opaque.executorch: inlining the opaque ops failed: "
                                   f"{error}")


def prepare(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` with every opaque call replaced by its body in ATen ops (Note
    [Opaque ops in ExecuTorch]); a program without opaque ops is returned as is.
    Raises :class:`ExecuTorchLoweringError` naming an op that cannot be inlined."""
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(
            f"torch_opaque.executorch expects a torch.export.ExportedProgram (or a dict of "
            f"them), got {type(ep).__name__}."
        )
    if not passes.list_opaque_ops(ep):
        return ep
    try:
        return passes.inline(ep)
    except (RuntimeError, ValueError) as e:
        raise _culprit(ep, e) from e


def to_edge_transform_and_lower(
    programs: Union[torch.export.ExportedProgram, Dict[str, torch.export.ExportedProgram]],
    *args: Any,
    **kwargs: Any,
):
    """``executorch.exir.to_edge_transform_and_lower`` of ``programs`` (one
    program, or a dict of method name -> program) after :func:`prepare` of each;
    the other arguments (``partitioner=``, ``compile_config=``,
    ``transform_passes=``, ...) go to ExecuTorch unchanged. Returns ExecuTorch's
    ``EdgeProgramManager`` (``.to_executorch()`` gives the ``.pte``)."""
    from executorch import exir

    if isinstance(programs, dict):
        programs = {name: prepare(ep) for name, ep in programs.items()}
    else:
        programs = prepare(programs)
    return exir.to_edge_transform_and_lower(programs, *args, **kwargs)
