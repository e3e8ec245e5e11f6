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

import contextlib

import torch

from . import extension_points as _ep
from .apply_route import ORIGINAL_APPLY
from .auto_state import AutoReport, _FALLEN, _note_op, _reports, _state, _torch_owned, _tracing, _why, active  # noqa: F401
from .auto_state import control_flow, eligible, fall_back, log, warn_if_traced_inline
from .function import wrap
from .registry import lookup
from .routing import ensure_routing, set_auto_call
from .tracing import real_shaped


def routed(cls: type):
    """The OpaqueFunction that a call of ``cls.apply`` runs now in this thread, or None."""
    fn = lookup(cls)
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
                wrap(cls, _patch_apply=False)
                fn = lookup(cls)
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



def call(cls: type, args: tuple, kwargs: dict):
    """``cls.apply(*args, **kwargs)`` inside auto() (Note [Auto fall-back])."""
    fn = routed(cls)
    if fn is None:
        warn_if_traced_inline(cls, args)
        return ORIGINAL_APPLY(cls, *args, **kwargs)
    if fn.explicit:
        return fn.apply(*args, **kwargs)
    if _ep.auto_runs_stock and _ep.runs_stock_in_auto(cls, (*args, *kwargs.values())):
        return ORIGINAL_APPLY(cls, *args, **kwargs)  # this call only: Note [Sharding opaque ops]
    # The first eager call runs the forward once, for real, as wrapped classes do
    # (Note [First call runs forward once]): no fake run (which imports Dynamo)
    # and, for forwards that cannot run on fake tensors (numpy, .item()), no
    # second real run that would draw other random numbers than stock.
    rng = primed = None
    try:
        values = fn.bind(args, kwargs)
        ov = fn.defined_overload(values)
        tracer = _ep.traced_by(values) if ov is None else None
        if tracer is not None:  # Note [FX symbolic tracing]
            return tracer.call(fn, values)
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



@contextlib.contextmanager
def auto():
    """Within this block (in this thread) every user autograd.Function whose
    ``apply`` is called (eagerly, by torch.export or by torch.compile) is
    wrapped as with ``torch_opaque.wrap`` and runs as an op. Classes that
    cannot be wrapped stay ordinary Functions, with a warning that says why
    (Note [Auto fall-back]). Yields an :class:`AutoReport` of what it did."""
    ensure_routing()
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


set_auto_call(call)
