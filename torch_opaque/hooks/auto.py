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
    >>> Cube.__module__ = "my_models"  # (a doctest runs inside torch_opaque, which auto() skips)
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Cube.apply(x) + 1
    >>> with torch_opaque.auto() as report:
    ...     ep = torch.export.export(M(), (torch.randn(3),))
    >>> any("Cube" in str(n.target) for n in ep.graph.nodes)
    True
    >>> list(report.ops.values())[0].startswith("opaque::Cube_")
    True

Note [Auto fall-back]
``auto()`` promises that a model that works without it works with it: a
Function that cannot be an op stays an ordinary Function, with a warning
that says why, and runs exactly as stock PyTorch runs it. Failures can show
up at every stage, and each is caught there:
- definition (ineligible class, a forward that calls ``ctx.mark_dirty``,
  a signature or annotations no schema carries): never wrapped;
- first call (schema from the values; in eager mode the forward runs once
  for real to learn its outputs, as for wrapped classes; traced calls probe
  with fake tensors): the call runs as the ordinary Function (if the forward
  already ran, again, with the CPU random state before it restored), and the
  class falls back only if that succeeds;
- the op call itself (the forward under the op's ctx, ctx state that cannot
  be encoded, a fake kernel while tracing): the same call is run again as the
  ordinary Function (with the CPU random state of the first call restored),
  and only if that succeeds is the class marked as fallen back: an error the
  stock Function raises too is the user's error and propagates unchanged;
- backward: the error propagates (the forward already ran as an op) with a
  note, and the class is fallen back from the next call on.
A call with DTensor arguments of a class that has no sharding rule runs as
the ordinary Function, that call only (Note [Sharding opaque ops]).
Exceptions that are control flow pass through every stage untouched, with no
re-run and no fall-back (Note [Control-flow exceptions]).
A fallen-back class met while a graph is exported (torch.export, strict or
not) gets one more warning: the trace inlines its forward, so its custom
backward is not in the graph (torch.compile keeps it: Dynamo traces a stock
Function with its backward). State is per thread (``auto()`` in one thread does not
change calls in another); the classes that fell back are remembered per
class (weakly) for the process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
import weakref
from typing import Optional

import torch

from .._impl import sharding as _sharding
from .._impl.in_place import uses_mark_dirty
from .._impl.tracing import real_shaped
from . import fx as _fx
from .apply import ORIGINAL_APPLY

log = logging.getLogger("torch_opaque")

class _State(threading.local):
    depth = 0  # open auto() blocks in this thread (read by hooks/apply.py's trampoline)
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


_PACKAGE_DIR = __file__.rsplit("/hooks/", 1)[0]


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


def routed(cls: type):
    """The OpaqueFunction that a call of ``cls.apply`` runs now in this thread, or None."""
    from .._impl import function

    fn = function.lookup(cls)
    if fn is not None and fn.explicit:
        return fn
    if not active():
        return None
    reason = _FALLEN.get(cls)
    if reason is not None:
        for report in _reports():
            report.fallbacks.setdefault(cls, reason)
        return None
    if fn is None:
        reason = eligible(cls)
        if reason is None:
            try:
                function.wrap(cls, _patch_apply=False)
                fn = function.lookup(cls)
            except Exception as e:  # definition stage: schema, naming, signature
                if control_flow(e):
                    raise
                reason = _why(e)
        if fn is None:
            if _torch_owned(cls):  # stock, silently
                return None
            fall_back(cls, reason)
            return None
    _note_op(cls, fn)
    return fn


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
    if torch.compiler.is_compiling() or _fx.traced_by_fx(args):  # Note [FX symbolic tracing]
        return True
    from torch import _guards

    if _guards.detect_fake_mode() is not None:
        return True
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)


def call(cls: type, args: tuple, kwargs: dict):
    """``cls.apply(*args, **kwargs)`` inside auto() (Note [Auto fall-back])."""
    fn = routed(cls)
    if fn is None:
        warn_if_traced_inline(cls, args)
        return ORIGINAL_APPLY(cls, *args, **kwargs)
    if fn.explicit:
        return fn.apply(*args, **kwargs)
    if _sharding.auto_call_runs_stock(cls, (*args, *kwargs.values())):
        return ORIGINAL_APPLY(cls, *args, **kwargs)  # this call only: Note [Sharding opaque ops]
    # The first eager call runs the forward once, for real, as wrapped classes do
    # (Note [First call runs forward once]): no fake run (which imports Dynamo)
    # and, for forwards that cannot run on fake tensors (numpy, .item()), no
    # second real run that would draw other random numbers than stock.
    rng = primed = None
    try:
        values = fn.bind(args, kwargs)
        ov = fn.defined_overload(values)
        if ov is None and _fx.traced_by_fx(values):  # Note [FX symbolic tracing]
            return _fx.call(fn, values)
        if ov is None:
            rng = None if _tracing(args) else torch.get_rng_state()
            ov, primed = fn.first_call(values)
    except Exception as e:  # first call: schema from the values, the forward's outputs
        if control_flow(e):  # Note [Control-flow exceptions]
            raise
        if rng is not None:
            torch.set_rng_state(rng)  # stock draws what the failed run drew
        out = _stock_instead(cls, args, kwargs, e)  # stock's own error propagates
        fall_back(cls, _why(e))
        warn_if_traced_inline(cls, args)
        return out
    first = ov.name not in fn.auto_checked
    tracing = first and _tracing(args)
    if primed is None:  # (primed: rng is from before the forward ran)
        rng = torch.get_rng_state() if first and not tracing else None
    try:
        if tracing:
            check_recording(ov, values)
        out = ov(values) if primed is None else ov.call_primed(values, *primed)
    except Exception as e:  # forward / fake kernel / ctx encoding under the op
        if control_flow(e):  # a checkpoint stop from its pack hook: Note [Control-flow exceptions]
            raise
        if rng is not None:
            torch.set_rng_state(rng)
        out = _stock_instead(cls, args, kwargs, e)  # stock's own error propagates
        fall_back(cls, f"its op failed ({_why(e)})")
        warn_if_traced_inline(cls, args)
        return out
    if first:
        fn.auto_checked.add(ov.name)
    return out


def _stock_instead(cls: type, args: tuple, kwargs: dict, why: BaseException):
    """The ordinary Function's call after its op failed with `why`.

    Note [No raw torch error from a fall-back]: when a traced forward cannot
    run on fake tensors (a solver layer such as qpth's QPFunction, whose
    stand-in runs fail its own checks) and the ordinary Function fails under
    the same trace (a guard on data-dependent values), stock's error says
    nothing of the fix; the call raises the FakeForwardError, which names it
    (a ``fake`` staticmethod), chained from stock's error, after the usual
    fall-back warning. An eager call's error is stock's own, unchanged."""
    try:
        return ORIGINAL_APPLY(cls, *args, **kwargs)
    except Exception as stock:
        from ..errors import FakeForwardError

        if control_flow(stock) or not isinstance(why, FakeForwardError) or not _tracing(args):
            raise
        fall_back(cls, _why(why))
        first = (str(stock).strip().splitlines() or [""])[0]
        raise FakeForwardError(
            f"{why}\ntorch_opaque.auto() traced {cls.__qualname__} as an ordinary "
            f"autograd.Function instead, which fails under this trace too "
            f"({type(stock).__name__}: {first})"
        ) from stock


def check_recording(ov, values) -> None:
    """First traced call of an auto-registered overload: run its fake forward
    as a training graph would (recording ctx), on fresh fake tensors outside the
    trace, so ctx state that cannot reach the backward is found now, while the
    call can still fall back, and not when the exported program is trained."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    runner = ov.fake_runner
    # no torch-function mode either: export's would record the no_grad below
    # (and any in the forward) as an empty region of the program
    with _disable_current_modes(), torch._C.DisableTorchFunction(), \
            FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        args = [real_shaped(v) for v in values]
        needs = [isinstance(v, torch.Tensor) for v in values]
        runner.run(needs, args, runner.guarded_forward, runner.guarded_setup)


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


@contextlib.contextmanager
def auto():
    """Within this block (in this thread) every user autograd.Function whose
    ``apply`` is called (eagerly, by torch.export or by torch.compile) is
    wrapped as with ``torch_opaque.wrap`` and runs as an op. Classes that
    cannot be wrapped stay ordinary Functions, with a warning that says why
    (Note [Auto fall-back]). Yields an :class:`AutoReport` of what it did."""
    from .._impl import function

    function.ensure_routing()
    report = AutoReport()
    reports = _reports()
    _state.depth += 1
    reports.append(report)
    try:
        yield report
    finally:
        reports.remove(report)
        _state.depth -= 1


def export(model, args, kwargs=None, **export_kwargs):
    """``torch.export.export`` with every autograd.Function kept as an opaque op.

    What became an op and what fell back is logged (logger ``torch_opaque``,
    level INFO) and kept on the result as ``ep.torch_opaque_report``."""
    with auto() as report:
        ep = torch.export.export(model, args, kwargs, **export_kwargs)
    log.info("%s", report)
    try:
        ep.torch_opaque_report = report
    except AttributeError:  # pragma: no cover - slots in a future ExportedProgram
        pass
    return ep
