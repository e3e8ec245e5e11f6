"""Forwards with side effects under torch.compile (Note [Forward side effects]
in torch_opaque/_impl/side_effects.py): auto() falls back to stock Dynamo; an
explicit wrap keeps the op when the effect is on state outside the call and
is refused when it is on an argument or an output; eager mode and export keep
the op."""

import math
import warnings

import pytest
import torch
from torch.distributions.utils import clamp_probs

import torch_opaque
from conftest import op_calls
from torch_opaque._impl import function as _function
from torch_opaque._impl import side_effect_scan, side_effects

LOG = []
SCALE = 0.5  # a global read (not changed) by the clean Function


def _probs():
    return torch.tensor([0.433, 0.766, 0.362, 0.635])


# ---- the Functions, one fresh class per test (auto() remembers fall-backs per class) ----


def make_quantize_bernoulli():
    # pyro/distributions/relaxed_straight_through.py, as pyro writes it.
    class QuantizeBernoulli(torch.autograd.Function):
        @staticmethod
        def forward(ctx, soft_value):
            hard_value = soft_value.round()
            hard_value._unquantize = soft_value
            return hard_value

        @staticmethod
        def backward(ctx, grad):
            return grad

    def caller(cls):
        def f(p):
            # RelaxedBernoulliStraightThrough: rsample then log_prob's unquantize
            hard = cls.apply(clamp_probs(p))
            value = getattr(hard, "_unquantize", hard)
            return value * 10

        return f, lambda: None

    return QuantizeBernoulli, caller, "sets the Python attribute ._unquantize on its output 'hard_value'"


def make_list_argument():
    class AppendToList(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out):
            out.append(x * 3)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    def caller(cls):
        out = []

        def f(x):
            return cls.apply(x, out) + 1

        return f, lambda: list(out)

    return AppendToList, caller, "calls .append() on its argument 'out' (a list)"


def make_global_list():
    class LogToGlobal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            LOG.append(x.sum())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def caller(cls):
        LOG.clear()
        return (lambda x: cls.apply(x) + 1), lambda: list(LOG)

    return LogToGlobal, caller, "calls .append() on the global 'LOG'"


def make_nonlocal_stash():
    stash = None

    class Stash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            nonlocal stash
            stash = x * 7
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def caller(cls):
        nonlocal stash
        stash = None
        return (lambda x: cls.apply(x) + 1), lambda: [stash]

    return Stash, caller, "assigns the closure variable 'stash' (nonlocal)"


def make_module_argument():
    class RememberOnModule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, module):
            module.last = x.detach() * 5
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    def caller(cls):
        m = torch.nn.Linear(1, 1)
        return (lambda x: cls.apply(x, m) + 1), lambda: [getattr(m, "last", None)]

    return RememberOnModule, caller, "sets the attribute .last of its argument 'module'"


CASES = {
    "pyro_quantize_bernoulli": make_quantize_bernoulli,
    "list_argument": make_list_argument,
    "global_list": make_global_list,
    "nonlocal_stash": make_nonlocal_stash,
    "module_argument": make_module_argument,
}


def _run(cls, caller, compile_backend=None, calls=2):
    """(results of `calls` calls, the effect seen after them)."""
    f, effect = caller(cls)
    if compile_backend is not None:
        f = torch.compile(f, backend=compile_backend)
    results = [f(_probs()) for _ in range(calls)]
    return results, effect()


def _assert_same(actual, expected):
    (a_out, a_eff), (e_out, e_eff) = actual, expected
    for a, e in zip(a_out, e_out, strict=True):
        torch.testing.assert_close(a, e)
    assert len(a_eff) == len(e_eff) if isinstance(e_eff, list) else a_eff == e_eff
    for a, e in zip(a_eff or [], e_eff or []):
        assert type(a) is type(e)  # torch.Tensor, never a FakeTensor
        if e is not None:
            torch.testing.assert_close(a, e)


def _fall_back_warnings(record, cls):
    return [
        str(w.message)
        for w in record
        if f"{cls.__qualname__} stays an ordinary autograd.Function" in str(w.message)
    ]


# ---- eager: the op, its effects as in stock ------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_auto_eager_matches_stock(case):
    cls, caller, _ = CASES[case]()
    expected = _run(cls, caller)
    cls, caller, _ = CASES[case]()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            actual = _run(cls, caller)
    _assert_same(actual, expected)
    if case == "module_argument":  # no schema carries a Module: stock, as before
        assert cls in report.fallbacks and "type Linear" in report.fallbacks[cls]
    elif case == "list_argument":  # the first call ran as the op, later ones stock
        assert cls in report.ops
        (warning,) = _fall_back_warnings(record, cls)
        assert (
            "because its forward changes the contents of its argument 'out' (a list), "
            "which the op's later calls would not repeat" in warning
        )
    else:
        assert cls in report.ops and not _fall_back_warnings(record, cls)


@pytest.mark.parametrize("case", ["pyro_quantize_bernoulli", "global_list", "nonlocal_stash"])
def test_wrapped_eager_matches_stock(case):
    cls, caller, _ = CASES[case]()
    expected = _run(cls, caller)
    wrapped = torch_opaque.wrap(type(cls.__name__, (cls,), {}))
    _assert_same(_run(wrapped, caller), expected)


def test_wrapped_list_argument_is_refused_in_eager():
    """The op's kernel passes the forward a new list: later calls would not append."""
    cls, caller, _ = make_list_argument()
    wrapped = torch_opaque.wrap(type("AppendToList", (cls,), {}))
    fn = _function.lookup(wrapped)
    f, _ = caller(wrapped)
    for _ in range(2):  # every call: no overload is defined
        with pytest.raises(torch_opaque.UnsupportedError) as info:
            f(_probs())
        assert str(info.value) == (
            f"torch_opaque: AppendToList.forward changes the contents of its argument 'out' "
            f"(a list): the op {fn.namespace}::{fn.name} passes its forward a new list at "
            f"each call, so that change would be lost from the next call on. Return the new "
            f"items as outputs of the forward instead, or keep AppendToList unwrapped."
        )
    assert not fn.overloads


# ---- torch.compile: auto() falls back, wrap refuses -----------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", CASES)
def test_auto_compile_falls_back_to_stock_dynamo(case, backend):
    cls, caller, effect = CASES[case]()
    expected = _run(cls, caller, backend)
    torch._dynamo.reset()
    cls, caller, _ = CASES[case]()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            actual = _run(cls, caller, backend)
    _assert_same(actual, expected)
    (warning,) = _fall_back_warnings(record, cls)
    assert f"because its forward {effect}, which torch.compile keeps only when Dynamo" in warning
    assert effect in report.fallbacks[cls] and cls not in report.ops


def test_pyro_values_under_compile_are_the_unquantized_sample():
    """The symptom: the op's output never had ``_unquantize``, so the compiled
    caller used the rounded sample ([0, 10, 0, 10])."""
    cls, caller, _ = make_quantize_bernoulli()
    with pytest.warns(UserWarning, match="QuantizeBernoulli stays an ordinary"):
        with torch_opaque.auto():
            (y, _), _ = _run(cls, caller, "aot_eager")
    torch.testing.assert_close(y, _probs() * 10)


def test_fallen_back_class_keeps_its_custom_backward_under_compile():
    """Stock Dynamo traces the Function, custom backward included: the
    straight-through gradient is 3 (autodiff of round would give 0)."""

    def grads(cls):
        p = _probs().requires_grad_()
        y = torch.compile(lambda p: cls.apply(p) * 3, backend="aot_eager")(p)
        return torch.autograd.grad(y.sum(), p)[0]

    expected = grads(make_quantize_bernoulli()[0])
    torch._dynamo.reset()
    cls = make_quantize_bernoulli()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_opaque.auto():
            actual = grads(cls)
    messages = [str(w.message) for w in caught]
    assert any("QuantizeBernoulli stays an ordinary" in m for m in messages), messages
    # (the export-only warning: under torch.compile the custom backward is kept)
    assert not any("custom backward is lost" in m for m in messages), messages
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual, torch.full((4,), 3.0))


OUTSIDE_THE_CALL = ["global_list", "nonlocal_stash"]  # state the op's kernel changes as stock


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", OUTSIDE_THE_CALL)
def test_wrapped_class_changing_outside_state_compiles_as_stock(case, backend):
    """The op stays an opaque call at run time (not inlined into Inductor's
    graph): its kernel runs the forward, and the effect, once per call; the
    fake runs of tracing leave no trace (tests/hooks/test_compile_counters.py
    counts)."""
    cls, caller, effect = CASES[case]()
    expected = _run(cls, caller, backend)
    torch._dynamo.reset()
    cls, caller, _ = CASES[case]()
    wrapped = torch_opaque.wrap(type("Wrapped" + cls.__name__, (cls,), {}))
    _assert_same(_run(wrapped, caller, backend), expected)
    assert _function.lookup(wrapped).side_effects == effect


@pytest.mark.parametrize("case", [c for c in CASES if c not in OUTSIDE_THE_CALL])
def test_wrapped_class_is_refused_under_compile(case):
    cls, caller, effect = CASES[case]()
    wrapped = torch_opaque.wrap(type("Wrapped" + cls.__name__, (cls,), {}))
    fn = _function.lookup(wrapped)
    with pytest.raises(Exception) as info:
        _run(wrapped, caller, "aot_eager", calls=1)
    text = str(info.value)
    assert "UnsupportedError" in text
    assert (
        f"torch_opaque: Wrapped{cls.__name__} is wrapped as the op {fn.namespace}::{fn.name}, "
        f"but its forward {effect}. Under torch.compile the op's forward runs only as a fake "
        f"kernel" in text
    )
    assert f"leave Wrapped{cls.__name__} unwrapped under torch.compile" in text


def test_effect_seen_in_eager_first_call_decides_under_compile():
    """``setattr`` is no STORE_ATTR: the bytecode shows nothing, the eager first
    call's run does."""

    class Tag(torch.autograd.Function):
        @staticmethod
        def forward(ctx, soft):
            hard = soft.round()
            setattr(hard, "_unquantize", soft)
            return hard

        @staticmethod
        def backward(ctx, g):
            return g

    wrapped = torch_opaque.wrap(type("Tag", (Tag,), {}))
    fn = _function.lookup(wrapped)
    assert side_effect_scan.static(fn) is None and fn.side_effects is None
    f, _ = make_quantize_bernoulli()[1](wrapped)
    torch.testing.assert_close(f(_probs()), _probs() * 10)  # eager: as stock
    assert fn.side_effects == "sets a Python attribute on its output (._unquantize)"
    with pytest.raises(Exception, match="sets a Python attribute on its output"):
        torch.compile(f, backend="aot_eager")(_probs())


def test_effect_seen_in_a_fake_run_while_tracing():
    """An alias of a global list (``log = LOG``) hides it from the bytecode scan;
    the watch around the forward's fake run while Dynamo traces sees it grow."""

    class AliasLog(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            log = LOG
            log.append(x.sum())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    LOG.clear()
    expected = torch.compile(lambda x: AliasLog.apply(x) + 1, backend="aot_eager")(_probs())
    torch._dynamo.reset()
    LOG.clear()
    cls = type("AliasLog", (AliasLog,), {})
    with pytest.warns(UserWarning, match="its forward changes the global 'LOG' \\(a list\\)"):
        with torch_opaque.auto() as report:
            y = torch.compile(lambda x: cls.apply(x) + 1, backend="aot_eager")(_probs())
    torch.testing.assert_close(y, expected)
    assert cls in report.fallbacks
    assert len(LOG) == 1 and type(LOG[0]) is torch.Tensor  # the fake runs' entries put back
    torch._dynamo.reset()
    LOG.clear()
    wrapped = torch_opaque.wrap(type("AliasLog", (AliasLog,), {}))
    y = torch.compile(lambda x: wrapped.apply(x) + 1, backend="aot_eager")(_probs())
    torch.testing.assert_close(y, expected)  # the op's kernel appends, once per call
    assert len(LOG) == 1 and type(LOG[0]) is torch.Tensor
    assert _function.lookup(wrapped).side_effects == "changes the global 'LOG' (a list)"


# ---- export keeps the op ----------------------------------------------------------------


def test_strict_export_keeps_the_op():
    cls, caller, _ = make_nonlocal_stash()

    class M(torch.nn.Module):
        def forward(self, x):
            return cls.apply(x) + 1

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            ep = torch.export.export(M(), (_probs(),), strict=True)
    fn = _function.lookup(cls)
    assert op_calls(ep.graph, fn.name) and not _fall_back_warnings(record, cls)
    assert cls in report.ops
    torch.testing.assert_close(ep.module()(_probs()), _probs() * 2 + 1)


# ---- no false positive -----------------------------------------------------------------------


def make_clean():
    class Clean(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k: float):
            parts = []
            parts.append(torch.add(x, 1.0))
            parts.extend([t * SCALE for t in (x, x)])
            table = {}
            table["k"] = k
            ctx.k = table["k"]
            ctx.scale = math.sqrt(4.0)
            idx = x.argmax()
            ctx.save_for_backward(x)
            ctx.mark_non_differentiable(idx)
            y = sum(parts) * k
            y.add(1.0)  # a tensor method named like a set's .add
            return y, idx

        @staticmethod
        def backward(ctx, g, _g_idx):
            (x,) = ctx.saved_tensors
            return g * ctx.k * (1 + 2 * SCALE) * ctx.scale / 2 + 0 * x, None

    return Clean


def _clean_caller(cls):
    return lambda x: cls.apply(x, 3.0)[0].exp()


class RecordGraphs:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, inputs):
        self.graphs.append(gm.graph)
        return gm.forward


@pytest.mark.parametrize("mode", ["auto", "wrap"])
def test_function_without_side_effects_compiles_to_the_op(mode):
    stock = make_clean()
    x = torch.randn(4, requires_grad=True)
    y_ref = _clean_caller(stock)(x)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x)

    cls = make_clean()
    if mode == "wrap":
        cls = torch_opaque.wrap(cls)
    backend = RecordGraphs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back warning
        with torch_opaque.auto():
            f = torch.compile(_clean_caller(cls), backend=backend, fullgraph=True)
            y = f(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(g, g_ref)
    fn = _function.lookup(cls)
    assert side_effect_scan.static(fn) is None and fn.side_effects is None
    (graph,) = backend.graphs
    (node,) = op_calls(graph, fn.name)
    assert node.target._schema.name == f"opaque::{fn.name}"


def test_eager_first_call_of_a_clean_function_records_nothing():
    cls = torch_opaque.wrap(make_clean())
    x = torch.randn(4, requires_grad=True)
    cls.apply(x, 3.0)
    assert _function.lookup(cls).side_effects is None
