"""Fake outputs from real runs on stand-in data, for forwards and backwards
whose Python depends on the data but whose output shapes follow the inputs.

Note [Fake from a real run]
A fake kernel runs the user's forward (or backward) on fake tensors. Published
Functions often branch on their data while their output shapes only follow
the input shapes: entmax's sparsemax (``if torch.any(unsolved)`` around a
topk whose k grows), gpytorch's ``LogNormalCDF`` (``if mask.any()`` around
``masked_select``), qpth's ``QPFunction`` (an iterative solver that stops when
the residual is small). On fake tensors such a branch is a guard on a
data-dependent value (``GuardOnDataDependentSymNode``, or, in a fake mode
without dynamic output shapes, ``DataDependentOutputException`` /
``DynamicOutputShapeException``): see :func:`is_data_dependent`.

When that happens and the user gave no ``fake``, the fake kernel derives its
outputs from real runs instead (:func:`outputs_from_real`):

* the traced arguments are replaced by stand-ins: real tensors on the same
  device of the same dtype with the sizes' concrete values (seeded ``randn``
  for floating tensors, zeros for integer and bool ones), symbolic ints by
  their values; the global RNG state is saved and restored around the runs
  (and Dynamo is off, Note [User bodies run without Dynamo] in tracing.py);
* the body runs twice, outside every fake / dispatch mode and without
  autograd: run A with the sizes' hints, run B with other data and, where
  sizes are symbolic, each free symbol moved to another value (hint + 1,
  hint + 2, ...), so two symbols equal by chance are told apart;
* every output size (and every state int of the forward record) is then
  matched: equal in both runs, it is that constant; else equal in both runs to
  one of the arguments' sizes or symbolic ints, it is that symbolic value; else
  the shape does not follow the inputs (``x[x > 0]``) and the run is refused
  with the FakeForwardError that asks for ``fake``. Output dtypes, the forward
  record (which tensors are saved, state) come from run A and must agree with
  run B;
* the fake outputs are new empty (contiguous) tensors of those shapes in the
  tracing mode. Residuals (tensors the forward keeps on ctx for its backward,
  such as gpytorch's ``ctx.denominator`` of the masked entries) may have
  data-dependent sizes: where no match is found they get new unbacked sizes
  (they are outputs of ``Name_fwd``, which binds them; refused where the
  shape environment does not allow dynamic output shapes, as torch.compile's
  by default), or, in a fake mode
  without a shape environment (first-call probes, auto()'s recording check,
  which only learn the call's structure), run A's size, unless the trace
  around that private mode refuses such sizes (so auto() falls back there).

The backward's fake (kernels.make_backward_fake) runs the backward on fake
tensors with fresh unbacked symbols ignored (snntorch's ``grad[input_ < 0] =
0`` makes one inside, but the gradients have the inputs' shapes: left pending,
it fails the trace with "Pending unbacked symbols ... not in returned
outputs"); a backward that hits a data-dependent guard or a dynamic-output op
(``grad[x >= 0] = -grad[x >= 0]`` where the mode does not allow them) gets
its gradients' fakes from real runs as above, none of them free.

The two runs are a check, not a proof: a data-dependent size that happens to
agree on both stand-ins is taken as constant. A body that fails on stand-in
data (it needs positive-definite matrices, say) gets the FakeForwardError too,
naming that failure. A body with side effects (counters, caches) sees them
twice more per trace; a ``fake`` avoids all of this.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from ..errors import TorchOpaqueError
from .tracing import FALLBACK_SIZE_HINT, dynamo_disabled

_SEEDS = (0x5EED, 0xC0FFEE)


def is_data_dependent(err: BaseException) -> bool:
    """Whether a fake run failed on a data-dependent value (Note [Fake from a real run])."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(
            err, (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
        ):
            return True
        err = err.__cause__ or err.__context__
    return False


class NotShapeFollowing(Exception):
    """A stand-in run whose outputs cannot be fakes of the traced call; the
    message says why (the caller turns it into its FakeForwardError)."""


# ---- sizes --------------------------------------------------------------------


def _symbolic(v: Any) -> bool:
    return isinstance(v, torch.SymInt) and not v.node.is_constant() and bool(
        getattr(v.node.expr, "free_symbols", ())
    )


def _symbols_of(values: Sequence) -> dict:
    """free symbol -> (shape env, its hint) over every symbolic size in ``values``."""
    out: dict = {}

    def visit(v):
        if isinstance(v, torch.Tensor):
            for s in (*v.shape, *v.stride()):
                visit(s)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif _symbolic(v):
            env = v.node.shape_env
            for s in v.node.expr.free_symbols:
                if s not in out:
                    known = getattr(env, "backed_var_to_val", None)
                    if known is None and env is not None:
                        known = env.var_to_val
                    h = known.get(s) if known is not None else None
                    try:
                        h = int(h) if h is not None else None
                    except (TypeError, ValueError):
                        h = None
                    if h is None:
                        vr = env.var_to_range.get(s) if env is not None else None
                        lo = getattr(vr, "lower", None)
                        try:
                            h = max(int(lo), 2) if lo is not None else FALLBACK_SIZE_HINT
                        except (TypeError, ValueError, OverflowError):
                            h = FALLBACK_SIZE_HINT
                    out[s] = h
    for v in values:
        visit(v)
    return out


def _value(v: Any, subs: dict) -> int:
    if _symbolic(v):
        return int(v.node.expr.xreplace(subs))
    return int(v)


# ---- stand-ins ----------------------------------------------------------------------


def _stand_in(v: Any, subs: dict, gen: torch.Generator, sign: float) -> Any:
    if isinstance(v, torch.Tensor):
        shape = [_value(s, subs) for s in v.shape]
        if v.device.type == "meta":
            raise NotShapeFollowing("its arguments are meta tensors (no real data to run on)")
        if v.dtype.is_floating_point or v.dtype.is_complex:
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * sign
            return t.to(dtype=v.dtype, device=v.device)
        return torch.zeros(shape, dtype=v.dtype, device=v.device)
    if isinstance(v, (list, tuple)):
        return type(v)(_stand_in(x, subs, gen, sign) for x in v)
    if isinstance(v, torch.SymInt):
        return _value(v, subs)
    if isinstance(v, torch.SymFloat):
        return float(v.node.hint) if v.node.hint is not None else 1.0
    if isinstance(v, torch.SymBool):
        return bool(v.node.hint) if v.node.hint is not None else False
    return v


def _devices(values) -> list:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.device.type not in ("cpu", "meta") and v.device not in out:
                out.append(v.device)
        elif isinstance(v, (list, tuple)):
            out.extend(d for d in _devices(v) if d not in out)
    return out


@contextlib.contextmanager
def _outside_tracing(values):
    """No fake / dispatch / torch function mode, no torch.func level, no
    autograd, Dynamo off, the global RNG state kept."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch.utils._python_dispatch import _disable_current_modes

    devices = [d for d in _devices(values) if d.type == "cuda"]
    # (torch function modes too: export records grad-mode changes through one)
    with _disable_current_modes(), torch._C.DisableTorchFunction(), \
            temporarily_clear_interpreter_stack(), torch.no_grad(), dynamo_disabled(), \
            torch.random.fork_rng(devices=devices):
        yield


def _size_pool(values: Sequence, subs_a: dict, subs_b: dict) -> list:
    """(symbolic value, value in run A, value in run B) of every symbolic size
    and symbolic int of the arguments."""
    pool = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                visit(s)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif _symbolic(v):
            pool.append((v, _value(v, subs_a), _value(v, subs_b)))

    for v in values:
        visit(v)
    return pool


def _match(a: int, b: int, pool: list, what: str):
    if a == b:
        return a
    for sym, va, vb in pool:
        if va == a and vb == b:
            return sym
    raise NotShapeFollowing(
        f"{what} is {a} in one stand-in run and {b} in another, not a size of the arguments: "
        f"it depends on the data"
    )


def _match_or_free(a: int, b: int, pool: list, values: Sequence):
    """A residual's size: as :func:`_match`, else a new data-dependent size
    (the residuals are outputs of ``Name_fwd``, which binds it). A fake mode
    without a shape environment (first-call probes, auto()'s recording check)
    cannot hold one: there the size of run A stands, as those runs only learn
    the call's structure."""
    try:
        return _match(a, b, pool, "")
    except NotShapeFollowing:
        pass
    env = getattr(_mode_of(values), "shape_env", None)
    if env is None:  # a private mode: the trace around it (if any) decides
        outer = getattr(torch._guards.detect_fake_mode(), "shape_env", None)
        if outer is None or getattr(outer, "allow_dynamic_output_shape_ops", True):
            return a
    if not getattr(env or outer, "allow_dynamic_output_shape_ops", True):
        raise NotShapeFollowing(
            f"a tensor it saves for backward has a size that depends on the data ({a} in one "
            f"stand-in run, {b} in another), which this trace does not allow "
            f"(torch._dynamo.config.capture_dynamic_output_shape_ops = True allows it)"
        )
    from .bridge import new_dynamic_size

    return new_dynamic_size(0, None)


def outputs_from_real(run: Callable, values: Sequence, free: int = -1) -> tuple:
    """(fake tensors, ints, extra) from ``run(*stand_ins)`` (Note [Fake from a
    real run]). ``run`` returns (tensors, ints, extra): the tensors to fake
    (each a Tensor or None), ints to match against the arguments' sizes (a
    forward record's state ints) and anything else, which must be equal in
    both runs. Results from index ``free`` on (a forward's residuals) may
    have sizes that depend on the data. Raises NotShapeFollowing."""
    syms = _symbols_of(values)
    subs_a = dict(syms)
    subs_b = {s: h + 1 + k for k, (s, h) in enumerate(syms.items())}
    results = []
    with _outside_tracing(values):
        for subs, seed, sign in ((subs_a, _SEEDS[0], 1.0), (subs_b, _SEEDS[1], -1.0)):
            gen = torch.Generator().manual_seed(seed)
            stand_ins = [_stand_in(v, subs, gen, sign) for v in values]
            try:
                results.append(run(*stand_ins))
            except (NotShapeFollowing, TorchOpaqueError):
                raise
            except Exception as e:
                raise NotShapeFollowing(
                    f"it also fails on stand-in data ({type(e).__name__}: {e})"
                ) from e
    (ta, ints_a, extra_a), (tb, ints_b, extra_b) = results
    if extra_a != extra_b:
        raise NotShapeFollowing("what it saves on ctx (or returns) depends on the data")
    pool = _size_pool(values, subs_a, subs_b)
    if len(ta) != len(tb):
        raise NotShapeFollowing("the number of results depends on the data")
    fakes = []
    for k, (x, y) in enumerate(zip(ta, tb)):
        if x is None or y is None:
            if (x is None) != (y is None):
                raise NotShapeFollowing(f"result {k} is None in one stand-in run only")
            fakes.append(None)
            continue
        if x.dim() != y.dim() or x.dtype != y.dtype:
            raise NotShapeFollowing(f"the rank or dtype of result {k} depends on the data")
        if 0 <= free <= k:
            shape = [_match_or_free(a, b, pool, values) for a, b in zip(x.shape, y.shape)]
        else:
            shape = [_match(a, b, pool, f"size {d} of result {k}") for d, (a, b) in
                     enumerate(zip(x.shape, y.shape))]
        fakes.append((shape, x.dtype, x.device))
    if len(ints_a) != len(ints_b):
        raise NotShapeFollowing("the number of ints saved on ctx depends on the data")
    ints = [_match(int(a), int(b), pool, f"ctx int {i}") for i, (a, b) in enumerate(zip(ints_a, ints_b))]
    made = tuple(None if f is None else torch.empty(f[0], dtype=f[1], device=f[2]) for f in fakes)
    return made, ints, extra_a


@contextlib.contextmanager
def discarding_fresh_unbacked(values: Sequence, ignore: bool = False):
    """Unbacked symbols a fake run creates are not left pending in the traced
    values' shape environment: when the run fails (``ignore`` False), or at all
    (``ignore`` True: a backward, whose gradients have the inputs' shapes, may
    mask and index inside, Note [Fake from a real run])."""
    env = getattr(_mode_of(values), "shape_env", None)
    if env is None:
        yield
        return
    pending = env.pending_fresh_unbacked_symbols
    n = len(pending)
    if ignore:
        with env.ignore_fresh_unbacked_symbols():
            yield
        return
    try:
        yield
    except BaseException:
        del pending[n:]
        raise


def _mode_of(values):
    """The fake mode of the traced values (not the tracing context's: a private
    mode inside a trace, as auto()'s recording check makes, is another), else
    the active one."""
    for t in _flat(values):
        mode = getattr(t, "fake_mode", None)
        if mode is not None:
            return mode
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _flat(values):
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_flat(v))
    return out
