"""The differences between the torch releases torch_opaque supports, each handled once.

Note [One place for each torch release difference]: torch_opaque supports
torch 2.13 to 2.15 (pyproject.toml) and tests each (Note [The release matrix]
in scripts/dev.sh). Where torch's behaviour differs between them in a way the
package must handle, the handling is a function of this module, with a Note
that says what differs, from which release, and what we do; the rest of the
package calls it instead of testing torch's version or probing torch's
attributes itself. Tests that meet a difference ask this module too, so
they assert each release's behaviour rather than skip one. Each function runs
on every release of the matrix (scripts/check_release_coverage.py).

(Differences handled before this module existed stay where they are and say
so in their Notes: Note [Apply in C] in _impl/apply_route.py, from 2.14, and the
C++ standard, Note [torch's C++ standard] in cmake/torch_opaqueFindTorch.cmake.)
"""

from __future__ import annotations

import inspect

import torch


# Note [ctx properties TorchScript cannot compile]: torch 2.15 adds the
# property FunctionCtx.input_grad_buffers, annotated
# `tuple[torch.Tensor | None, ...]`, a type TorchScript's parser refuses
# ("Expression of type dots cannot be used in a type expression"). When
# scripted code calls `Cls.apply` of a Function that is not routed to an op,
# TorchScript first compiles the class, with every property it inherits, and
# only then makes the call a Python call; on 2.15 the property ends that with
# the error, so nothing calling a stock Function scripts at all: not stock
# Functions, not those auto() leaves stock (Note [TorchScript and wrapped
# classes] in integrations/torchscript.py). TorchScript skips the properties a class
# names in `__jit_unused_properties__`, so, when the TorchScript hook is
# installed, FunctionCtx names its own there (torch.jit cannot use a ctx
# property anyway: a Function is never run by TorchScript itself). On 2.13
# and 2.14 FunctionCtx has no properties and nothing changes.
def hide_ctx_properties_from_torchscript() -> list[str]:
    """Names FunctionCtx's properties in its ``__jit_unused_properties__``; returns them."""
    ctx = torch.autograd.function.FunctionCtx
    names = sorted(n for n, v in inspect.getmembers(ctx) if isinstance(v, property))
    if names:
        kept = list(getattr(ctx, "__jit_unused_properties__", []))
        ctx.__jit_unused_properties__ = kept + [n for n in names if n not in kept]
    return names


# Note [Aliases bound before routing, where apply is C]: on torch 2.13
# Function.apply is Python code, which torch_opaque swaps in place, so every
# alias `f = Cls.apply`, bound whenever, reaches the route (Note [Apply
# interception] in _impl/apply_route.py). From 2.14 it is a C method and the route
# is a new Function.apply attribute (Note [Apply in C]): an alias bound before
# it is installed keeps the C method and runs the stock Function, silently,
# even inside auto() (docs/auto.md's first example: `cube = Cube.apply` at
# module level, then auto(), gave "0 op(s)", Cube traced into ATen ops and
# its backward lost). So on those releases importing torch_opaque installs
# the route (Function.apply replaced; Dynamo's hook stays lazy, torch._dynamo
# is not imported): aliases bound after `import torch_opaque` are routed, as
# on 2.13; only those bound before it are not (docs/limits.md). On 2.13
# importing changes nothing in torch, and the first wrap/op/auto() installs
# the route as before.
def route_apply_on_import() -> bool:
    """Installs the apply route now where Function.apply is C code; whether it did."""
    from ._impl import apply_route as apply_hook

    if apply_hook._C_APPLY is None:
        return False
    from ._impl.routing import ensure_routing

    ensure_routing()
    return True
