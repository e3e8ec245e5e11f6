"""Counters a forward keeps, after N calls, against the stock Function (Note
[Fake runs leave no trace] and Note [Forward side effects] in
torch_opaque/_impl/side_effects.py): the probe, auto()'s recording check and
the fake kernels' runs never count, so eager mode, aot_eager and Inductor give
what stock gives, under auto() (which falls back under compile) and under
wrap (whose op stays opaque at run time, its kernel counting once per call)."""

import types
import warnings

import pytest
import torch

import torch_opaque
from conftest import op_calls
from torch_opaque._impl import function as _function

CALLS = {"n": 0}
N = 0
STATE = types.SimpleNamespace(calls=0)
CALLS_SEEN = []


def _bump():
    CALLS["n"] += 1


# ---- the Functions, in the styles packages use (one fresh class per use) ---------------------


def make_subscript():
    class SubscriptCounter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            CALLS["n"] += 1
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def read():
        return CALLS["n"]

    def reset():
        CALLS["n"] = 0

    return SubscriptCounter, read, reset


def make_global():
    class GlobalCounter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            global N
            N += 1
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            return g

    def reset():
        global N
        N = 0

    return GlobalCounter, lambda: N, reset


def make_class_attribute():
    class ClassCounter(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            ClassCounter.calls += 1
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    def reset():
        ClassCounter.calls = 0

    return ClassCounter, lambda: ClassCounter.calls, reset


def make_nonlocal():
    count = 0

    class ClosureCounter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            nonlocal count
            count += 1
            return x + 1

        @staticmethod
        def backward(ctx, g):
            return g

    def reset():
        nonlocal count
        count = 0

    return ClosureCounter, lambda: count, reset


def make_object_attribute():
    class ObjectCounter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            STATE.calls += 1
            return x * 3

        @staticmethod
        def backward(ctx, g):
            return g * 3

    def reset():
        STATE.calls = 0

    return ObjectCounter, lambda: STATE.calls, reset


def make_helper():
    class HelperCounter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            _bump()
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def reset():
        CALLS["n"] = 0

    return HelperCounter, lambda: CALLS["n"], reset


def make_global_log():
    class LogCalls(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            CALLS_SEEN.append(x.shape[0])
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    return LogCalls, lambda: len(CALLS_SEEN), CALLS_SEEN.clear


CASES = {
    "subscript_augmented": make_subscript,
    "global": make_global,
    "class_attribute": make_class_attribute,
    "nonlocal": make_nonlocal,
    "object_attribute": make_object_attribute,
    "helper": make_helper,
    "global_list": make_global_log,
}
BACKENDS = ["eager", "aot_eager", "inductor"]
CALLS_N = 3


def _counted(cls, read, reset, backend):
    """(outputs, gradients, counter) after CALLS_N calls, each with a backward."""
    reset()

    def f(x):
        return cls.apply(x) * 1.5

    if backend != "eager":
        f = torch.compile(f, backend=backend)
    outs, grads = [], []
    for i in range(CALLS_N):
        x = torch.linspace(-1, 1, 4).add(i).requires_grad_()
        y = f(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        outs.append(y.detach())
        grads.append(g)
    return outs, grads, read()


def _stock(case, backend):
    cls, read, reset = CASES[case]()
    got = _counted(cls, read, reset, backend)
    torch._dynamo.reset()
    return got


def _same(got, ref):
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    assert got[2] == ref[2] == CALLS_N


def _fall_backs(caught, cls):
    return [str(w.message) for w in caught if f"{cls.__qualname__} stays an ordinary" in str(w.message)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_auto_counts_as_stock(case, backend):
    ref = _stock(case, backend)
    cls, read, reset = CASES[case]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            got = _counted(cls, read, reset, backend)
    _same(got, ref)
    if backend == "eager":  # the op, its forward run once per call
        assert cls in report.ops and not _fall_backs(caught, cls)
    else:  # stock Dynamo traces the forward and replays the effect
        assert cls in report.fallbacks and len(_fall_backs(caught, cls)) == 1


class RecordGraphs:
    def __init__(self, backend):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(backend)
        self.graphs = []

    def __call__(self, gm, inputs):
        self.graphs.append(gm)
        return self.inner(gm, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_wrap_counts_as_stock_and_keeps_the_op(case, backend):
    ref = _stock(case, backend)
    cls, read, reset = CASES[case]()
    wrapped = torch_opaque.wrap(type(cls.__name__, (cls,), {}))
    if case == "class_attribute":  # the subclass's forward counts on the base class
        read, reset = (lambda: cls.calls), (lambda: setattr(cls, "calls", 0))
    recorder = None if backend == "eager" else RecordGraphs(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing refused, nothing said
        warnings.filterwarnings("ignore", module="torch")
        got = _counted(wrapped, read, reset, recorder or "eager")
    _same(got, ref)
    if recorder is not None:
        fn = _function.lookup(wrapped)
        (gm,) = recorder.graphs
        assert op_calls(gm, fn.name), gm.graph  # the op, not the forward's body
        assert fn.side_effects  # seen, so Inductor keeps the call opaque


@pytest.mark.parametrize("case", CASES)
def test_export_runs_leave_no_count(case):
    """torch.export keeps the op; its fake runs (probe, recording check, fake
    kernel) count nothing; the exported program's calls count as its op runs."""
    cls, read, reset = CASES[case]()
    reset()

    class M(torch.nn.Module):
        def forward(self, x):
            return cls.apply(x) + 1

    with torch_opaque.auto() as report:
        ep = torch.export.export(M(), (torch.randn(4),))
    assert cls in report.ops, str(report)
    assert read() == 0
    assert op_calls(ep.graph, _function.lookup(cls).name)
    for _ in range(CALLS_N):
        ep.module()(torch.randn(4))
    assert read() == CALLS_N


def test_fake_run_changes_are_put_back_through_an_alias():
    """The bytecode cannot follow ``log = CALLS_SEEN``: the quiet fake runs put
    the list back, and auto() falls back when it sees it changed."""

    class AliasLog(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            log = CALLS_SEEN
            log.append(x.shape[0])
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    ref = _counted(AliasLog, lambda: len(CALLS_SEEN), CALLS_SEEN.clear, "aot_eager")
    torch._dynamo.reset()
    cls = type("AliasLog", (AliasLog,), {})
    with pytest.warns(UserWarning, match="changes the global 'CALLS_SEEN'"):
        with torch_opaque.auto():
            got = _counted(cls, lambda: len(CALLS_SEEN), CALLS_SEEN.clear, "aot_eager")
    _same(got, ref)
    assert CALLS_SEEN == [4] * CALLS_N  # real sizes, never a FakeTensor's
