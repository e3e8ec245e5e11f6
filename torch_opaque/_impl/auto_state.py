"""What ``auto()`` keeps: its per-thread state (open blocks, their reports)
and the classes that fell back, with why (Note [Auto fall-back] in
auto_mode.py), read by the apply route and by the integrations that meet
calls (Dynamo, sharding, TorchScript)."""

from __future__ import annotations

import functools
import logging
import threading
import warnings
import weakref
from typing import Optional

import torch

from . import extension_points as _ep
from .in_place import uses_mark_dirty

log = logging.getLogger("torch_opaque")

class _State(threading.local):
    depth = 0  # open auto() blocks in this thread (read by _impl/apply_route.py's trampoline)
    reports = None  # their AutoReports


_state = _State()
_FALLEN: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()
_WARNED_TRACE: "weakref.WeakSet[type]" = weakref.WeakSet()


class AutoReport:
    """What one ``auto()`` block did (it is what ``with torch_opaque.auto() as r`` gives):

    - ``ops``: class -> qualified op name, for each Function that ran as an op;
    - ``fallbacks``: class -> why, for each Function that stayed ordinary.

    ``str(report)`` is a readable table.
    """

    def __init__(self):
        self.ops: dict = {}
        self.fallbacks: dict = {}

    def __str__(self):
        lines = [f"torch_opaque.auto(): {len(self.ops)} op(s), {len(self.fallbacks)} fall-back(s)"]
        for cls, name in self.ops.items():
            lines.append(f"  op        {_cls_name(cls)} -> {name}")
        for cls, why in self.fallbacks.items():
            lines.append(f"  ordinary  {_cls_name(cls)}: {why}")
        return "\n".join(lines)

    __repr__ = __str__


_PACKAGE_DIR = __file__.rsplit("/_impl/", 1)[0]


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside torch_opaque and torch (the user's call)."""
    import os
    import sys

    torch_dir = os.path.dirname(torch.__file__)
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith((_PACKAGE_DIR, torch_dir)):
        f, level = f.f_back, level + 1
    return level


def _cls_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def active() -> bool:
    """Whether the calling thread is inside ``auto()``."""
    return _state.depth > 0


def _reports() -> list:
    r = _state.reports
    if r is None:
        r = _state.reports = []
    return r


def _torch_owned(cls) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module == "torch" or module.startswith(("torch.", "torch_opaque"))


def eligible(cls: type) -> Optional[str]:
    """None when auto mode should wrap ``cls``; otherwise why not."""
    if _torch_owned(cls):
        return "it belongs to PyTorch"
    if cls.backward is torch.autograd.Function.backward:
        return "it defines no backward"
    if uses_mark_dirty(cls):
        return "its forward calls ctx.mark_dirty (an in-place Function; auto() keeps those stock)"
    return None


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.removeprefix("torch_opaque: ")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# Note [Control-flow exceptions]
# Some exceptions that leave an op call are not the op's failure but control
# flow of the code around it: non-reentrant checkpoint stops its recomputation
# by raising torch.utils.checkpoint._StopRecomputationError from its pack hook
# once it has every tensor it needs (i.e. from inside the op's autograd kernel,
# while it saves the op's residuals); a user's saved_tensors_hooks pack hook may
# raise on purpose; KeyboardInterrupt, SystemExit and other BaseExceptions that
# are not Exceptions stop the program. Stock runs none of them twice, so auto()
# must neither re-run the call as the ordinary Function (that would run the
# hook again: checkpoint then finds its state broken, "Unexpected state:
# target_frame.early_stop is set", and a stateful hook may not raise a second
# time, hiding the user's error) nor mark the class fallen back: the exception
# propagates unchanged, as stock's does. control_flow() tells them apart: not
# an Exception, a checkpoint stop, or raised while a frame of the active
# saved-tensor hooks was running (found in the exception's traceback; the
# autograd kernel calls the pack hook after the forward succeeded, so such an
# error says nothing of the op). Unpack hooks run in the engine before the
# op's backward is called, so they never reach the backward guard; a backward
# that raises control flow itself is not a backward failure either.


def _hook_codes(hooks) -> set:
    codes = set()
    for h in hooks or ():
        for _ in range(4):  # a partial, a bound method, a callable object
            if isinstance(h, functools.partial):
                h = h.func
            elif hasattr(h, "__func__"):
                h = h.__func__
            elif hasattr(h, "__code__") or not callable(h):
                break
            else:
                h = getattr(type(h), "__call__", None)
        code = getattr(h, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def control_flow(e: BaseException) -> bool:
    """Whether ``e`` is control flow that auto() passes through untouched
    (Note [Control-flow exceptions])."""
    if not isinstance(e, Exception):
        return True
    from torch.utils.checkpoint import _StopRecomputationError

    if isinstance(e, _StopRecomputationError):
        return True
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except Exception:  # pragma: no cover - another torch version
        return False
    codes = _hook_codes(hooks)
    if not codes:
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def fall_back(cls: type, reason: str) -> None:
    """Keep ``cls`` an ordinary Function from now on, saying why (once)."""
    if cls in _FALLEN:
        return
    _FALLEN[cls] = reason
    for report in _reports():
        report.fallbacks.setdefault(cls, reason)
    log.info("auto(): %s stays an ordinary autograd.Function: %s", _cls_name(cls), reason)
    if not _torch_owned(cls):
        warnings.warn(
            f"torch_opaque.auto(): {cls.__qualname__} stays an ordinary autograd.Function "
            f"(inlined by export) because {reason}",
            stacklevel=_user_stacklevel(),
        )


def fallen_back(cls: type) -> Optional[str]:
    """Why auto mode keeps ``cls`` an ordinary Function, or None."""
    return _FALLEN.get(cls)


def _note_op(cls, fn) -> None:
    for report in _reports():
        if cls not in report.ops:
            report.ops[cls] = f"{fn.namespace}::{fn.name}"
            log.info("auto(): %s runs as op %s::%s", _cls_name(cls), fn.namespace, fn.name)




def warn_if_traced_inline(cls: type, args=()) -> None:
    """A fallen-back class met while tracing: its backward is not in the graph."""
    if cls in _WARNED_TRACE or cls not in _FALLEN or _torch_owned(cls):
        return
    if not _tracing(args):
        return
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return  # Dynamo traces a stock Function with its backward (a compiled graph keeps it)
    _WARNED_TRACE.add(cls)
    warnings.warn(
        f"torch_opaque.auto(): {cls.__qualname__} is traced as an ordinary autograd.Function "
        f"({_FALLEN[cls]}), so the graph inlines its forward and its custom backward is lost "
        f"there: gradients of the traced model are autodiff of the forward. Fix the reason "
        f"above or keep this model out of export.",
        stacklevel=_user_stacklevel(),
    )


def _tracing(args) -> bool:
    if torch.compiler.is_compiling() or _ep.traced_by(args) is not None:  # Note [FX symbolic tracing]
        return True
    from torch import _guards

    if _guards.detect_fake_mode() is not None:
        return True
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)



def backward_failed(cls: type, e: BaseException) -> None:
    """Backward stage: the forward already ran as an op, so this error stands;
    later calls run the ordinary Function. Control flow raised by the backward
    is no failure of it (Note [Control-flow exceptions])."""
    if cls is None or control_flow(e):
        return
    fall_back(cls, f"its backward failed under the op ({_why(e)})")
    e.add_note(
        f"torch_opaque.auto(): {cls.__qualname__}.backward failed when run by its op; "
        f"{cls.__qualname__} runs as an ordinary autograd.Function from its next call on."
    )

