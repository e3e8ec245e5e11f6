"""Warning where an in-place Function's op is traced under autocast (Note
[Autocast while tracing]).

Note [Autocast while tracing]
Other Functions record the autocast state into the call (Note [Autocast in the
call] in autocast_variant.py); this is what is left for in-place ones
(``ctx.mark_dirty``), whose op has no autocast variant yet. In eager code the op's forward runs under the caller's autocast state, as a
stock Function's does (the kernels keep the thread's autocast state: Note
[User code sees autograd]). A traced program does not: ``torch.export``
(``run_decompositions``, ``ep.module()``) and ``torch.compile`` apply
autocast at the level of the traced graph, where the op is one node, so its
body is traced and run in the dtypes of its inputs, while stock inlines the
body and autocasts each of its ops: under ``torch.autocast("cpu",
torch.bfloat16)`` a stock ``x @ w`` gives bfloat16, the op's float32. Until
the autocast state is recorded into the call, nothing of this is silent:
under torch.compile ``auto()`` runs a call traced under an enabled autocast
as the stock Function (stock Dynamo inlines the body and gets the dtypes
right; that call only: the class stays an op for the others), and an
explicitly wrapped class keeps its op (AMP training with torch.compile goes
on working; many bodies do not care: pointwise ops on already-cast inputs)
with one warning per op that names the class and the ways out. torch.export
of such a call warns too where it can see the autocast block. Two places see it: Dynamo's handling of
``Cls.apply`` (torch.compile and strict export; autocast entered inside the
compiled code is one of Dynamo's context managers, entered outside it the
thread's state) and the fake kernel (non-strict export, whose pre-dispatch
trace records autocast blocks instead of entering them, and the graph
tracing after Dynamo).
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch


def _describe(device_type: str) -> str:
    dtype = torch.get_autocast_dtype(device_type)
    return f"torch.autocast({device_type!r}, dtype={dtype})"


def active_for(values: Iterable) -> Optional[str]:
    """The enabled autocast (thread state) for the devices of these values' tensors, or None."""
    seen = set()
    for v in values:
        items = v if isinstance(v, (list, tuple)) else (v,)
        for t in items:
            if isinstance(t, torch.Tensor):
                seen.add(t.device.type)
    for device_type in sorted(seen):
        try:
            if torch.is_autocast_enabled(device_type):
                return _describe(device_type)
        except RuntimeError:  # a device type autocast does not know
            continue
    return _in_pre_dispatch_trace()


def _in_pre_dispatch_trace() -> Optional[str]:
    """An enabled autocast block that torch.export's pre-dispatch trace is inside:
    there autocast is recorded (``_enter_autocast`` nodes, later a
    ``wrap_with_autocast`` region), not set on the thread."""
    from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
    from torch.overrides import _get_current_function_mode_stack

    for mode in _get_current_function_mode_stack():
        if not isinstance(mode, PreDispatchTorchFunctionMode):
            continue
        for node in getattr(mode, "enter_autocast_nodes", ()):
            args = list(node.args)
            if len(args) >= 3 and args[2]:
                return f"torch.autocast({args[0]!r}, dtype={args[1]})"
    return None


def active_in_dynamo(tx) -> Optional[str]:
    """The enabled ``torch.autocast`` block Dynamo is tracing inside, or None."""
    from torch._dynamo.variables.ctx_manager import AutocastModeVariable

    while tx is not None:
        for entry in getattr(tx, "block_stack", ()):
            ctx = getattr(entry, "with_context", None)
            if isinstance(ctx, AutocastModeVariable):
                values = list(getattr(ctx, "target_values", ()) or ())
                if len(values) >= 3 and values[2]:
                    return f"torch.autocast({values[0]!r}, dtype={values[1]})"
        tx = getattr(tx, "parent", None)
    return None


_WARNED: set = set()


def warn_once(display_name: str, op_name: str, autocast: str, stacklevel: int = 3) -> None:
    """The warning an explicitly wrapped class gets, once per op."""
    if op_name in _WARNED:
        return
    _WARNED.add(op_name)
    warnings.warn(
        f"torch_opaque: {display_name} (the op {op_name}) is traced under {autocast}, which the "
        f"op does not follow in traced programs yet: torch.export and torch.compile run its "
        f"body in the dtypes of its inputs, where the stock Function's ops would be autocast "
        f"(Note [Autocast while tracing]). Cast its inputs inside the autocast region yourself "
        f"if its body needs the autocast dtypes, or use torch_opaque.auto(), which keeps such "
        f"calls ordinary Functions under torch.compile.",
        stacklevel=stacklevel,
    )


def warn_call_falls_back(cls: type, autocast: str) -> None:
    """auto(): this traced call runs as the stock Function (the class stays an
    op for other calls); said once per class, and listed in the AutoReports."""
    from ..hooks import auto

    reason = (f"it is traced under {autocast}, which the op does not follow in traced "
              f"programs yet (Note [Autocast while tracing]); calls outside autocast stay the op")
    for report in auto._reports():
        report.fallbacks.setdefault(cls, reason)
    key = ("auto", cls.__module__, cls.__qualname__, id(cls))
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"torch_opaque.auto(): {cls.__qualname__} runs as an ordinary autograd.Function in this "
        f"compiled call because {reason}.",
        stacklevel=3,
    )
