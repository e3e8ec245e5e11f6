"""Zero-code-change mode: every autograd.Function met becomes an opaque op.

Example::

    >>> import torch, torch_opaque
    >>> class Cube(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x ** 3
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 3 * x ** 2 * g
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Cube.apply(x) + 1
    >>> ep = torch_opaque.export(M(), (torch.randn(3),))
    >>> any("Cube" in str(n.target) for n in ep.graph.nodes)
    True
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Optional

import torch

from . import function as _function
from .errors import SchemaError

_state = threading.local()
_lock = threading.Lock()
_depth = 0  # process-wide: Function.apply is patched while any auto() is active


def active() -> bool:
    return _depth > 0 and not getattr(_state, "suspended", False)


def eligible(cls: type) -> Optional[str]:
    """None when auto mode should wrap ``cls``; otherwise why not."""
    module = getattr(cls, "__module__", "") or ""
    if module == "torch" or module.startswith(("torch.", "torch_opaque")):
        return "it belongs to PyTorch"
    if cls.backward is torch.autograd.Function.backward:
        return "it defines no backward"
    return None


def routed(cls: type):
    """The OpaqueFunction that a call of ``cls.apply`` runs now, or None."""
    fn = _function.lookup(cls)
    if fn is not None and (fn.explicit or active()):
        return fn
    if not active():
        return None
    reason = eligible(cls)
    if reason is None:
        try:
            _function.wrap(cls, _patch_apply=False)
            return _function.lookup(cls)
        except Exception as e:  # schema, naming
            reason = str(e)
    warn_unwrapped(cls, reason)
    return None


def warn_unwrapped(cls: type, reason: str) -> None:
    module = getattr(cls, "__module__", "") or ""
    if module == "torch" or module.startswith("torch."):
        return
    warnings.warn(
        f"torch_opaque.auto(): {cls.__qualname__} stays an ordinary autograd.Function "
        f"(inlined by export) because {reason}",
        stacklevel=4,
    )


def _auto_apply(cls, *args, **kwargs):
    fn = routed(cls)
    if fn is not None:
        try:
            values = fn.bind(args, kwargs)
            ov = fn.overload_for(values)
        except SchemaError as e:
            if fn.explicit:
                raise
            warn_unwrapped(cls, str(e))
        else:
            return ov(values)
    return _function._ORIGINAL_APPLY(cls, *args, **kwargs)


_auto_apply.__name__ = "apply"


@contextlib.contextmanager
def auto():
    """Within this block every user autograd.Function whose ``apply`` is called
    (eagerly, by torch.export or by torch.compile) is wrapped as with
    ``torch_opaque.wrap`` and runs as an op. Classes that cannot be wrapped stay
    ordinary Functions, with a warning that says why."""
    global _depth
    with _lock:
        if _depth == 0:
            torch.autograd.Function.apply = classmethod(_auto_apply)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.autograd.Function.apply = classmethod(_function._ORIGINAL_APPLY)


def export(model, args, kwargs=None, **export_kwargs):
    """``torch.export.export`` with every autograd.Function kept as an opaque op."""
    with auto():
        return torch.export.export(model, args, kwargs, **export_kwargs)
