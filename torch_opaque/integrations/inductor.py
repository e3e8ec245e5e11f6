"""Inductor compiles the bodies of wrapped Functions (their forward and backward
as ATen), so it fuses them with the code around them.

Note [Inductor sees through opaque ops]
In a graph Inductor compiles, an opaque op would be an extern call: Inductor
runs the Python kernels of ``Name_fwd`` / ``Name_bwd`` and fuses nothing
across them, while stock ``torch.compile`` traces an autograd.Function's body
and fuses it with its neighbours (issue #28 measured up to 1.55x stock
compiled code for MLPs of small Linear layers; benchmarks/bench_compiled.py).

So each ``Name_fwd`` and ``Name_bwd`` of a Function wrapped from Python has an
entry in Inductor's own decomposition table
(``torch._inductor.decomposition.decompositions`` and its cached copy with the
random decompositions), and nowhere else: not in
``torch._decomp.decomposition_table``, which FakeTensor prefers over the op's
fake kernel under symbolic shapes and which DTensor and torch.onnx read. The
table is what AOTAutograd traces Inductor's joint graph with, below autograd:

- ``Name_fwd``'s entry runs the user's forward as the op's fake kernel does
  (same runner, same needs_input_grad, grad mode off), on the traced tensors,
  so its ATen ops are recorded in the graph, and hands the forward record to
  the Autograd kernel (``_C.set_forward_record``). The record's ctx state is
  encoded (the tensors it holds are residuals, Note [Eager state is for
  nodes] in include/torch_opaque/forward_record.h), so ``Name_bwd`` gets it
  as its ``state`` / ``state_ints`` arguments, as in any traced graph;
- ``Name_bwd``'s entry runs the user's backward on those arguments (the same
  runner as its kernel), so the custom backward is the one Inductor compiles,
  not a derivative of the forward.

The residuals stay the ones the forward saved; the partitioner may still
recompute cheap ones. Only tables that ask for decompositions see the bodies:
``torch.export``, ``export_training``, archives and ONNX keep one opaque node
per call, and so do AOTInductor packages (``V.aot_compilation``: they run
from C++ and are built from exported programs).

A body that cannot be traced to ATen keeps the opaque call: before the traced
run, the body runs once on the same fake tensors with tracing off, and the
entry declines (returns NotImplemented, so the op's fake kernel runs and the
graph keeps the call, whose Python kernel runs at run time) when that raises
(numpy, data-dependent Python: anything a FakeTensor refuses) or writes into
an argument. A debug line on the ``torch_opaque`` logger says why. A body
that writes into its own tensors (``y.clamp_(min=0)``, ``g[x < 0] = 0``) is
traced under functionalization, as AOTAutograd's is: the entries run below
AOTAutograd's own, which in-place ops would escape. In-place Functions
(``ctx.mark_dirty``) and ops defined in C++ keep their calls.

Under Inductor the bodies' Python runs when the graph is traced, not per call
(as for code stock torch.compile traces): a print in a forward runs at compile
time only. A forward with side effects (Note [Forward side effects] in
side_effects.py: a counter, a log, a stash in a global or closure variable,
seen by the bytecode scan, an eager first call or the check run here) keeps
the opaque call, so its kernel applies the effect once per call, as stock's
compiled code replays it; the check run's own effect is put back (Note [Fake
runs leave no trace]).

``torch_opaque.config.inductor_inline = False`` keeps every call opaque in
compiled code (read per compile; ``torch._dynamo.reset()`` drops graphs
compiled before). The tables hold the OpOverloads; Note [Ops that graphs
hold] does not count those references (``table_references``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import config
from .._native import _C
from .._impl import side_effect_scan, side_effects
from .._impl.extension_points import AfterFirstImport
from .._impl.fake_from_real import discarding_fresh_unbacked
from .._impl.tracing import dynamo_disabled

log = logging.getLogger("torch_opaque")

# OpOverload -> entry, for every overload defined (weakly: the overload owns them).
_ENTRIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tables() -> list:
    """Inductor's decomposition tables that exist now."""
    mod = sys.modules.get("torch._inductor.decomposition")
    if mod is None:
        return []
    tables = [mod.decompositions]
    cached = getattr(mod, "fast_random_decomps", None)
    info = getattr(cached, "cache_info", None)
    if info is not None and info().currsize:
        tables.append(cached())
    return tables


def _enabled() -> bool:
    if not config.inductor_inline:
        return False
    v = sys.modules.get("torch._inductor.virtualized")
    return not (v is not None and v.V.aot_compilation)


@contextlib.contextmanager
def _nothing():
    yield None


class _Writes(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes the first op that writes into a tensor."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.seen is None and func._schema.is_mutable:
            self.seen = func
        return func(*args, **(kwargs or {}))


def _decline(op) -> object:
    """NotImplemented, the op's call staying in the graph: Inductor lowers it
    to a call of its kernel, as it would an op without an entry (make_fallback
    refuses an op that has a decomposition, hence done here, once per op)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    if op not in lowering.lowerings:
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)
    return NotImplemented


def _has_side_effects(fn) -> bool:
    """A forward that changes state outside its outputs (Note [Forward side
    effects]): inlined, its effect would happen once, when the graph is
    traced; kept an opaque call, its kernel applies it at each call."""
    return fn is not None and bool(fn.side_effects or side_effect_scan.static(fn))


def _check(run, values, name: str, what: str, fn=None):
    """``run(values)`` once on these fake tensors with tracing off (fresh
    unbacked symbols dropped): None when it cannot be inlined (it raised,
    wrote into its arguments, or changed state outside the call: put back,
    Note [Fake runs leave no trace]), else whether it writes into its own tensors."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    inputs = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]
    versions = [t._version for t in inputs]
    writes = _Writes()
    watch = None
    try:
        with disable_proxy_modes_tracing(), discarding_fresh_unbacked(values, ignore=True):
            with writes, side_effects.quiet(fn, values) if fn is not None else _nothing() as watch:
                run(values)
    except Exception as e:  # anything a fake tensor refuses: numpy, data-dependent Python
        why = f"it cannot run on fake tensors ({type(e).__name__}: {e})"
    else:
        if watch is not None and watch.effect:
            fn.side_effects = fn.side_effects or watch.effect
            why = f"its forward {watch.effect}"
        elif [t._version for t in inputs] == versions:
            return writes.seen is not None
        else:
            why = f"it modifies its argument in place ({writes.seen})"
    log.debug("torch_opaque: %s %s stays an opaque call in Inductor's graph: %s "
              "(Note [Inductor sees through opaque ops])", name, what, why)
    return None


def _functional(run, values):
    """``run(values)`` traced with its in-place ops made functional, as
    AOTAutograd's functionalization (which the entries run below) does."""
    from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    with FunctionalTensorMode():
        out = run(tree_map_only(torch.Tensor, to_fun, values))
    return tree_map_only(torch.Tensor, from_fun, out)


def _traced(run, values, name: str, what: str, fn=None):
    """``run(values)`` traced into the graph, or NotImplemented (Note [Inductor
    sees through opaque ops])."""
    writes = _check(run, values, name, what, fn)
    if writes is None:
        return NotImplemented
    return _functional(run, values) if writes else run(values)


class _ForwardEntry:
    """``Name_fwd``'s entry: the forward as its fake kernel runs it (the real
    forward, not a user ``fake``), on the traced tensors."""

    def __init__(self, runner, op, fn=None):
        self.runner = runner
        self.op = weakref.ref(op)
        self.fn = (lambda: None) if fn is None else weakref.ref(fn)

    def __call__(self, *args, **kwargs):
        fn = self.fn()
        if not _enabled() or _has_side_effects(fn):
            return _decline(self.op())
        r = self.runner
        args, kwargs, needs = r.signature.split_needs_input_grad(args, kwargs)
        if kwargs or len(args) != r.n_args:
            args = r.complete(args, kwargs)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            with dynamo_disabled():
                got = _traced(lambda a: r.run(needs, a), list(args), r.fn_name, "forward", fn)
        finally:
            torch._C._set_grad_enabled(prev)
        if got is NotImplemented:
            return _decline(self.op())
        outs, residuals, record = got
        if record is not None:
            _C.set_forward_record(*record)
        return (*outs, residuals)


class _BackwardEntry:
    """``Name_bwd``'s entry: the user's backward on its arguments."""

    def __init__(self, runner, op):
        self.runner = runner
        self.op = weakref.ref(op)

    def __call__(self, saved, grads, needs_input_grad, state, state_ints):
        if not _enabled():
            return _decline(self.op())
        r = self.runner

        def run(values):
            saved, grads, ints = values
            return list(r(saved, grads, needs_input_grad, state, ints)[0])

        with dynamo_disabled():
            got = _traced(run, [list(saved), list(grads), list(state_ints)], r.fn_name, "backward")
        return _decline(self.op()) if got is NotImplemented else got


def add(overload) -> None:
    """Entries for ``overload``'s ``_fwd`` and ``_bwd`` (a Function wrapped from
    Python, not in place), in Inductor's tables now and when Inductor loads."""
    if overload.dirty:
        return
    _ENTRIES[overload.fwd_op] = _ForwardEntry(overload.runner, overload.fwd_op, overload.fn)
    _ENTRIES[overload.bwd_op] = _BackwardEntry(overload.bwd_runner, overload.bwd_op)
    for table in _tables():
        table[overload.fwd_op] = _ENTRIES[overload.fwd_op]
        table[overload.bwd_op] = _ENTRIES[overload.bwd_op]
    _arm()


def remove(overload) -> None:
    """Drop ``overload``'s entries (its ops are being released)."""
    for op in (overload.fwd_op, overload.bwd_op):
        _ENTRIES.pop(op, None)
        for table in _tables():
            table.pop(op, None)


def table_references(op) -> int:
    """How many references to ``op`` Inductor's tables hold for torch_opaque
    (Note [Ops that graphs hold] does not count them as a graph's)."""
    return sum(1 for table in _tables() if op in table) if op in _ENTRIES else 0


_armed = False


def _arm() -> None:
    """Inductor's tables get the entries when its decomposition module loads,
    and AOTAutograd's cache check is told about opaque ops when it loads."""
    global _armed
    if _armed:
        return
    _armed = True
    def tables_loaded(_module):
        for table in _tables():
            table.update(_ENTRIES)

    if "torch._inductor.decomposition" in sys.modules:
        tables_loaded(None)
    else:
        AfterFirstImport("torch._inductor.decomposition", tables_loaded).arm()
    name = "torch._functorch._aot_autograd.autograd_cache"
    if name in sys.modules:
        _bypass_aot_cache(sys.modules[name])
    else:
        AfterFirstImport(name, _bypass_aot_cache).arm()


# Note [Opaque ops bypass AOTAutograd's cache]
# AOTAutogradCache keys a compiled region on its Dynamo graph, where an
# opaque call is only the op's name: not the Function's bodies, which the
# compiled code holds once Inductor inlines them (nor the ctx state that
# ``Name_bwd`` calls carry as constants). A cached entry would outlive an
# edit of the Function's forward or backward. So a Dynamo graph that calls
# an op wrapped from Python is not cached by AOTAutograd (a bypass, counted
# in its counters); Inductor's FX graph cache, keyed on the graph it
# compiles (the bodies included), still serves the compiled kernels.


def _bypass_aot_cache(module) -> None:
    original = getattr(module, "check_node_safe", None)
    if original is None or getattr(original, "_torch_opaque", False):
        return
    from ..ops import opaque_info

    def check_node_safe(node):
        if node.op == "call_function":
            target = node.target
            if isinstance(target, torch._ops.OpOverloadPacket):
                targets = [getattr(target, o) for o in target.overloads()]
            else:
                targets = [target]
            for t in targets:
                info = opaque_info(t)
                if info is not None and info.function is not None:
                    raise module.BypassAOTAutogradCache(
                        f"torch_opaque: {t} runs a Python Function whose bodies are not in "
                        f"the cache key (Note [Opaque ops bypass AOTAutograd's cache])"
                    )
        return original(node)

    check_node_safe._torch_opaque = True
    module.check_node_safe = check_node_safe
