"""Rerouting ``torch.autograd.Function.apply``, aliases included.

Note [Apply interception]
Packages often keep ``f = MyFunction.apply`` (at module level, in
``__init__``, in dicts) and call ``f`` later. Every such alias is a bound
method of one function object, ``torch.autograd.Function.apply.__func__``,
so binding it earlier or later makes no difference: whatever runs that
function's code sees every call. We therefore keep the function object (and
the ``Function.apply`` attribute) as they are and swap only its ``__code__``
for a two-line trampoline that calls ``route(cls, *args, **kwargs)``;
``route`` (torch_opaque._impl.function.route_apply) runs the op of a wrapped class
(or, inside ``auto()``, of an eligible class) and otherwise calls
``ORIGINAL_APPLY``, a copy of the function with the original code and the
same closure, so stock behaviour is unchanged.

Why not replace the attribute: Dynamo recognises an alias by comparing it
with ``getattr(alias.__self__, "apply")``; with a different function there,
the comparison fails and tracing stops (``Unresolved GetAttrVariable
comparison``). A TorchFunctionMode does not see ``apply`` at all.

The original code has one free variable, ``__class__`` (its ``super()``);
the trampoline is compiled inside a class body so that it has the same one,
and the function keeps its closure. The trampoline finds ``route`` as a
global of torch.autograd.function, under a name torch does not use, with the
registry (``_BY_ID``) and auto mode's thread-local state, so that a call of a
class torch_opaque does not route costs two C-level lookups more than stock.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Callable, Optional

import torch

# The globals the trampoline reads, set in torch.autograd.function's namespace.
_GLOBAL = "_torch_opaque_route_apply"  # route(cls, *args, **kwargs)
_GLOBALS = (_GLOBAL, "_torch_opaque_original_apply", "_torch_opaque_by_id", "_torch_opaque_auto")
_APPLY = None  # torch.autograd.Function.apply.__func__, once checked


def _target() -> Optional[types.FunctionType]:
    """The function whose code we swap, or None (with a warning) when this
    torch version's Function.apply is not what Note [Apply interception] expects."""
    attr = inspect.getattr_static(torch.autograd.Function, "apply", None)
    func = getattr(attr, "__func__", None)
    problem = None
    if not isinstance(attr, classmethod) or not isinstance(func, types.FunctionType):
        problem = f"torch.autograd.Function.apply is a {type(attr).__name__}, not a classmethod"
    elif func.__code__.co_freevars != ("__class__",):
        problem = f"its code has free variables {func.__code__.co_freevars}, not ('__class__',)"
    elif any(g in func.__globals__ for g in _GLOBALS):
        problem = f"torch.autograd.function already defines {_GLOBAL}"
    if problem:
        warnings.warn(
            f"torch_opaque: cannot route aliases of autograd.Function.apply on torch "
            f"{torch.__version__} ({problem}); `f = Cls.apply` kept from before wrapping runs "
            f"the ordinary Function. Call Cls.apply directly, or report this torch version.",
            stacklevel=3,
        )
        return None
    return func


class _Template:
    def apply(cls, *args, **kwargs):
        __class__  # noqa: B018  the one free variable Function.apply's code has
        # Unrouted calls (no OpaqueFunction for cls, not inside auto() in this
        # thread) go straight to the original code: two C-level lookups.
        if _torch_opaque_by_id.get(id(cls)) is None and not _torch_opaque_auto.depth:  # noqa: F821
            return _torch_opaque_original_apply(cls, *args, **kwargs)  # noqa: F821
        return _torch_opaque_route_apply(cls, *args, **kwargs)  # noqa: F821


_TRAMPOLINE = _Template.apply.__code__.replace(co_name="apply", co_qualname="Function.apply")


def _copy_original() -> types.FunctionType:
    func = torch.autograd.Function.apply.__func__
    code = func.__code__
    if code is _TRAMPOLINE:  # pragma: no cover - installed by another copy of this module
        raise RuntimeError("torch_opaque: Function.apply was rerouted twice")
    f = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    f.__kwdefaults__ = func.__kwdefaults__
    f.__qualname__ = func.__qualname__
    f.__doc__ = func.__doc__
    f.__module__ = func.__module__
    return f


# Stock Function.apply (its code, its closure): what unrouted calls run.
ORIGINAL_APPLY = _copy_original()


def install_apply_route(route: Callable, by_id: dict, auto_state) -> bool:
    """Make every call of ``Function.apply`` (aliases included) of a class in
    ``by_id`` (keyed by ``id(cls)``), or of any class while ``auto_state.depth``
    is set in the calling thread, go through ``route(cls, *args, **kwargs)``.
    Idempotent; False when torch's Function.apply is not as expected (nothing
    is changed then)."""
    global _APPLY
    if _APPLY is not None:
        return True
    func = _target()
    if func is None:
        return False
    func.__globals__.update(
        {
            _GLOBAL: route,
            "_torch_opaque_original_apply": ORIGINAL_APPLY,
            "_torch_opaque_by_id": by_id,
            "_torch_opaque_auto": auto_state,
        }
    )
    func.__code__ = _TRAMPOLINE
    _APPLY = func
    return True


def is_apply(obj) -> bool:
    """Whether ``obj`` is the (rerouted) function behind every ``Cls.apply``."""
    return obj is torch.autograd.Function.apply.__func__
