"""What an op call's ``grad_fn`` shows of its ctx (Note [Backward node
introspection] in csrc/autograd_kernel.h).

A stock Function's ``grad_fn`` is its ctx, and code reads it::

    >>> import torch, torch_opaque
    >>> @torch_opaque.op
    ... class Scale(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x, k: float):
    ...         ctx.k = k
    ...         ctx.save_for_backward(x)
    ...         return x * k
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * ctx.k, None
    >>> y = Scale.apply(torch.ones(2, requires_grad=True), 3.0)
    >>> y.grad_fn.k, y.grad_fn.needs_input_grad, y.grad_fn._forward_cls is Scale
    (3.0, (True, False), True)
    >>> y.grad_fn.saved_tensors[0].shape
    torch.Size([2])

The C++ type of the node (csrc/python/backward_node_type.cpp) calls the two
functions below for what only Python knows.
"""

from __future__ import annotations

from typing import Optional


def forward_cls(namespace: str, name: str) -> Optional[type]:
    """The Function class whose op ``namespace::name`` is, or None (a C++ op)."""
    from .function import function_for_op

    fn = function_for_op(namespace, name)
    return None if fn is None else fn.cls_ref()


def decode(namespace: str, name: str, overload: str, state: str, saved: tuple, state_ints):
    """(explicitly saved tensors, ctx attributes) from a node's encoded ctx state."""
    from .function import function_for_op

    fn = function_for_op(namespace, name)
    ov = None if fn is None else fn.overloads.get(overload or "default")
    if ov is None:
        return saved, None
    return ov.bwd_runner.decode_ctx(state, saved, list(state_ints))



def explicit_count(state: str) -> int:
    """How many of a node's saved tensors forward saved with save_for_backward
    (the tensor attributes of ctx, encoded in `state`, follow them)."""
    from .context import parsed_state

    return int(parsed_state(state)[0])
