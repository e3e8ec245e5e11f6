"""The arguments of a call to an opaque op, once: filling in the ones passed by
keyword or left to their defaults, separating `_fwd`'s trailing
needs_input_grad, and telling tensor arguments from the others.

Every Python caller that receives an op's arguments as PyTorch passes them
(fake kernels, graph-pass decompositions, stored programs, ONNX export)
goes through :class:`CallSignature`.

Example::

    >>> import torch
    >>> from torch_opaque._impl.calls import CallSignature
    >>> sig = CallSignature.of_schema(torch._C.parse_schema("f(Tensor x, float s=2.) -> Tensor"))
    >>> sig.complete([1], {})
    [1, 2.0]
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch

# `_fwd`'s last argument (Note [needs_input_grad of _fwd] in csrc/opaque_op.cpp).
NEEDS_INPUT_GRAD = "needs_input_grad"


class CallSignature:
    """The names and defaults of an op's arguments, in schema order."""

    __slots__ = ("name", "names", "defaults")

    def __init__(self, name: str, names: Sequence[str], defaults: dict):
        self.name = name  # for messages
        self.names = tuple(names)
        self.defaults = dict(defaults)

    @classmethod
    def of_schema(cls, schema, name: Optional[str] = None) -> "CallSignature":
        """The signature of a FunctionSchema (without `_fwd`'s trailing
        needs_input_grad; `_bwd`'s needs_input_grad is one of its arguments)."""
        args = list(schema.arguments)
        if args and args[-1].name == NEEDS_INPUT_GRAD and schema.name.endswith("_fwd"):
            args.pop()
        return cls(
            name or schema.name,
            [a.name for a in args],
            {a.name: a.default_value for a in args if a.has_default_value()},
        )

    @classmethod
    def of_specs(cls, name: str, specs) -> "CallSignature":
        """The signature of a forward described by schema.ArgSpec objects."""
        return cls(
            name,
            [s.name for s in specs],
            {s.name: s.default for s in specs if s.default is not inspect.Parameter.empty},
        )

    def complete(self, args: Sequence, kwargs: dict) -> list:
        """All arguments by position: those passed by keyword put in place,
        missing ones given their defaults; a missing argument without default
        is an error."""
        out = list(args)
        if len(out) > len(self.names):
            raise TypeError(
                f"torch_opaque: {self.name} takes {len(self.names)} arguments "
                f"({', '.join(self.names)}), got {len(out)}."
            )
        for n in self.names[len(out) :]:
            if n in kwargs:
                out.append(kwargs[n])
            elif n in self.defaults:
                out.append(self.defaults[n])
            else:
                raise TypeError(
                    f"torch_opaque: {self.name}: missing argument '{n}'; pass it by position "
                    f"or by keyword."
                )
        return out

    def split_needs_input_grad(self, args: Sequence, kwargs: dict) -> tuple:
        """(args, kwargs, needs_input_grad) of a call that may be a `_fwd` call,
        whose trailing needs_input_grad is separated (None when absent: a call
        of the op itself, or one that leaves it to its default)."""
        if NEEDS_INPUT_GRAD in self.names:  # `_bwd`: an argument like the others
            return tuple(args), dict(kwargs), None
        kwargs = dict(kwargs)
        needs = kwargs.pop(NEEDS_INPUT_GRAD, None)
        n = len(self.names)
        if len(args) > n:
            needs = args[n]
            args = args[:n]
        return tuple(args), kwargs, needs

    def arguments(self, args: Sequence, kwargs: dict) -> list:
        """All arguments of a possibly `_fwd` call, by position, without its
        needs_input_grad."""
        args, kwargs, _ = self.split_needs_input_grad(args, kwargs)
        return self.complete(args, kwargs)


def tensor_kind(arg) -> str:
    """What a schema argument holds: 'tensor' (Tensor / Tensor?), 'tensors'
    (Tensor[] / Tensor?[]) or 'value' (anything else)."""
    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return "tensor"
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        if isinstance(e, torch.OptionalType):
            e = e.getElementType()
        if isinstance(e, torch.TensorType):
            return "tensors"
    return "value"


def tensor_flags(schema) -> tuple:
    """Per argument of `schema`: whether it is a Tensor (or Tensor?)."""
    return tuple(tensor_kind(a) == "tensor" for a in schema.arguments)


def full_args(schema, args: Sequence, kwargs: dict) -> list:
    """All arguments of a call of `schema`'s op (or of its `_fwd`, whose
    needs_input_grad is dropped) by position."""
    return CallSignature.of_schema(schema).arguments(args, kwargs)


def bind(schema, args: Sequence, kwargs: dict) -> list:
    """(schema argument, value) for every argument of a call."""
    sig = CallSignature.of_schema(schema)
    values = sig.arguments(args, kwargs)
    return list(zip(schema.arguments[: len(sig.names)], values))
