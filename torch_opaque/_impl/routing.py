"""Where a ``Function.apply`` call goes once routing is installed: the op of a
wrapped class, auto mode's choice inside ``auto()``, else the stock Function
(Note [Apply interception] in apply_route.py)."""

from __future__ import annotations

from . import extension_points as _ep
from .apply_route import ORIGINAL_APPLY, install_apply_route
from .auto_state import _state as _auto_state
from .registry import _BY_ID

# auto_mode.call, set when auto_mode.py is imported (torch_opaque/__init__.py
# imports it): auto mode wraps classes, so it stands above this module.
_auto_call = None


def set_auto_call(call) -> None:
    global _auto_call
    _auto_call = call


def route_apply(cls, *args, **kwargs):
    """Every ``Function.apply`` call once routing is installed (Note [Apply
    interception] in apply_route.py), and the fallback of the C-level
    ``Cls.apply`` of wrapped classes: the op of a wrapped class, auto mode's
    choice inside ``auto()``, else the stock Function."""
    fn = _BY_ID.get(id(cls))
    if fn is not None and fn.explicit and fn.cls_ref() is cls:
        return fn.apply(*args, **kwargs)
    if _auto_state.depth > 0:
        return _auto_call(cls, args, kwargs)
    return ORIGINAL_APPLY(cls, *args, **kwargs)


route_apply.__name__ = "apply"
_ROUTING = False


def ensure_routing() -> None:
    """Install the apply interception once, and tell the integrations
    (the lazy Dynamo, TorchScript and ONNX hooks: Note [Extension points])."""
    global _ROUTING
    if _ROUTING:
        return
    install_apply_route(route_apply, _BY_ID, _auto_state)
    _ep.fire(_ep.routing_installed)
    _ROUTING = True
