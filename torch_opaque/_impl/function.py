"""Turning a torch.autograd.Function subclass into an opaque operator: ``wrap`` and ``op``.

Example::

    >>> import torch, torch_opaque
    >>> @torch_opaque.op(name="MySin")
    ... class MySin(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.sin()
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         (x,) = ctx.saved_tensors
    ...         return grad * x.cos()
    >>> x = torch.randn(3, requires_grad=True)
    >>> MySin.apply(x).sum().backward()        # runs torch.ops.opaque.MySin
    >>> bool(torch.allclose(x.grad, x.detach().cos()))
    True
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .._native import _C
from .apply_route import ORIGINAL_APPLY as _ORIGINAL_APPLY
from .opaque_function import OpaqueFunction
from .registry import _BY_OPNAME, _LOCK, _PENDING_RELEASE, _free_name, _release_pending
from .registry import add as _add, default_name, function_for_op, is_wrapped, lookup  # noqa: F401 (re-exported)
from .routing import ensure_routing, route_apply

DEFAULT_NAMESPACE = "opaque"


def _make_apply(cls: type, fn: OpaqueFunction):
    """``cls.apply``: a C-level DirectApply with ``route_apply`` as its fallback."""
    apply = _C.DirectApply(cls, route_apply)
    apply.__name__ = "apply"
    apply.__qualname__ = f"{cls.__qualname__}.apply"
    apply.__doc__ = f"Runs the op {fn.namespace}::{fn.name} (torch_opaque); {cls.__qualname__} is unchanged."
    apply.__signature__ = inspect.signature(_ORIGINAL_APPLY)  # (cls, *args, **kwargs)
    return apply


def _check_wrappable(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(
            f"torch_opaque: expected a torch.autograd.Function subclass, got {cls!r}. "
            f"Decorate the class itself (not an instance or its apply)."
        )
    if cls.backward is torch.autograd.Function.backward:
        raise TypeError(
            f"torch_opaque: {cls.__qualname__} defines no backward; an opaque op needs one. "
            f"Add a backward staticmethod."
        )


def wrap(
    cls: type,
    *,
    name: Optional[str] = None,
    namespace: str = DEFAULT_NAMESPACE,
    _patch_apply: bool = True,
) -> type:
    """Make ``cls.apply`` call a registered operator; the class body is unchanged.

    For classes you cannot edit (they live in another package)::

        torch_opaque.wrap(their_module.TheirFunction)

    Wrapping twice is harmless; asking for a different name the second time is an
    error. Returns ``cls``.
    """
    _check_wrappable(cls)
    ensure_routing()
    with _LOCK:
        existing = lookup(cls)
        if existing is not None:
            if (name and name != existing.name) or namespace != existing.namespace:
                raise ValueError(
                    f"torch_opaque: {cls.__qualname__} is already wrapped as "
                    f"{existing.namespace}::{existing.name}; it cannot also be "
                    f"{namespace}::{name or default_name(cls)}. Wrap it once."
                )
            if _patch_apply and not existing.explicit:
                existing.explicit = True
                cls.apply = classmethod(_make_apply(cls, existing))
            return cls
        if _PENDING_RELEASE:
            _release_pending()
        if name:
            op_name = name
            other = _BY_OPNAME.get((namespace, op_name))
            if other is not None:
                o = other.cls_ref()
                where = f"{o.__module__}.{o.__qualname__}" if o is not None else "a freed class"
                raise ValueError(
                    f"torch_opaque: op name {namespace}::{op_name} is already used by "
                    f"{where}; pass a different name= for {cls.__module__}.{cls.__qualname__}."
                )
        else:
            op_name = _free_name(namespace, default_name(cls))
        fn = OpaqueFunction(cls, namespace, op_name, explicit=_patch_apply)
        _add(fn)
        if _patch_apply:
            cls.apply = classmethod(_make_apply(cls, fn))
    if _patch_apply:
        fn.define_from_hints()
    return cls


def op(cls: Optional[type] = None, *, name: Optional[str] = None, namespace: str = DEFAULT_NAMESPACE):
    """Class decorator: ``@torch_opaque.op`` or ``@torch_opaque.op(name=..., namespace=...)``.

    Afterwards ``Cls.apply(...)`` (and every alias of it) runs
    ``torch.ops.<namespace>.<name>``, and every export path keeps the call as
    one node; the class body is unchanged. Same as :func:`wrap`.

    * Name: ``name`` or ``<Qualname>_<6 hex digits of the module name>``
      (stable across processes); namespace ``"opaque"`` by default.
    * Schema: from the type hints when every forward argument is annotated
      (one overload, registered right away when the return is annotated too);
      otherwise from the kinds of each call's arguments (``Name.Tensor_float``...).
    * Tracing runs the forward on fake tensors; a forward that cannot (numpy,
      ``.item()``) gets a ``fake`` staticmethod with forward's signature that
      returns outputs of the right shape and saves the same tensors.

    Example::

        >>> import torch, torch_opaque
        >>> @torch_opaque.op(name="DocOpScale")
        ... class Scale(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ...         ctx.k = k
        ...         return x * k
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return g * ctx.k, None
        >>> print(torch.ops.opaque.DocOpScale.default._schema)
        opaque::DocOpScale(Tensor x, float k) -> Tensor
        >>> x = torch.ones(2, requires_grad=True)
        >>> Scale.apply(x, 3.0).sum().backward()
        >>> x.grad
        tensor([3., 3.])
    """
    if cls is None:
        return lambda c: wrap(c, name=name, namespace=namespace)
    return wrap(cls, name=name, namespace=namespace)

