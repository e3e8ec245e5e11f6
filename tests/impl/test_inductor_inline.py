"""Inductor compiles the bodies of wrapped Functions (Note [Inductor sees
through opaque ops] in torch_opaque/integrations/inductor.py): the generated
code has no call of the op, values and gradients are the stock Function's;
bodies that cannot be traced keep the call (with a debug line saying why), so
does ``config.inductor_inline = False``, and export graphs keep one opaque
node per call."""

import contextlib
import gc
import logging
import weakref

import pytest
import torch
from torch._inductor import decomposition
from torch._inductor.utils import run_and_get_code

import torch_opaque
from conftest import op_calls


class SiLUish(torch.autograd.Function):
    """A float and a tensor attribute on ctx, a size from the input (a symbol
    under dynamic shapes): state that travels as residuals and _bwd arguments."""

    @staticmethod
    def forward(ctx, x, beta: float):
        s = torch.sigmoid(x * beta)
        ctx.save_for_backward(x)
        ctx.s = s
        ctx.beta = beta
        ctx.n = x.shape[0]
        return x * s

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = ctx.s
        return g * (s + ctx.beta * x * s * (1 - s)) * (ctx.n / x.shape[0]), None


class DataDependent(torch.autograd.Function):
    """Python control flow on the data: no ATen trace exists."""

    @staticmethod
    def forward(ctx, x):
        return x * 2 if x.sum() > 0 else x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 2


class InPlaceBody(torch.autograd.Function):
    """In-place ops on its own tensors (the Function itself is not in place):
    traced under functionalization."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = x.clone()
        y.clamp_(min=0)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gi = g.clone()
        gi[x < 0] = 0
        return gi


def wrapped(cls, name):
    return torch_opaque.wrap(type(name, (cls,), {}), name=name)


def model(act, dd, ip):
    def f(x, w):
        h = act.apply(x @ w, 1.5)
        return (ip.apply(dd.apply(h)) + h).sum()

    return f


def grads(f, x, w):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = f(x, w)
    return (y, *torch.autograd.grad(y, (x, w)))


@contextlib.contextmanager
def opaque_log():
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("torch_opaque")
    prior = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(prior)


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    return torch.randn(6, 8), torch.randn(8, 8)


def compiled_code(f, x, w, **compile_kw):
    torch._dynamo.reset()
    out, codes = run_and_get_code(lambda: grads(torch.compile(f, **compile_kw), x, w))
    return out, "\n".join(codes)


def test_inlined_where_traceable_kept_where_not(inputs):
    """One compile: an inlined Function with ctx state (dynamic shapes), one
    whose body writes into its own tensors (inlined), one that branches on
    its data (kept, its backward inlined)."""
    x, w = inputs
    act, dd, ip = (wrapped(SiLUish, "IiSiLU"), wrapped(DataDependent, "IiDataDep"),
                   wrapped(InPlaceBody, "IiInPlace"))
    want = grads(model(SiLUish, DataDependent, InPlaceBody), x, w)
    from torch._dynamo.utils import counters

    bypassed = counters["aot_autograd"]["autograd_cache_bypass"]
    with opaque_log() as lines:
        got, code = compiled_code(model(act, dd, ip), x, w, backend="inductor", dynamic=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # calls of the ops (kernel names may hold the op's name as their source)
    assert "opaque.IiSiLU_" not in code  # forward and backward compiled by Inductor
    assert "opaque.IiDataDep_fwd" in code and "opaque.IiDataDep_bwd" not in code  # (traces)
    assert "opaque.IiInPlace_" not in code
    assert any("IiDataDep forward stays an opaque call" in m and "fake tensors" in m
               for m in lines), lines
    assert not any("IiInPlace" in m for m in lines), lines
    # Note [Opaque ops bypass AOTAutograd's cache]
    assert counters["aot_autograd"]["autograd_cache_bypass"] > bypassed


def test_switched_off_keeps_the_calls(inputs, monkeypatch):
    x, w = inputs
    act = wrapped(SiLUish, "IiSiLUOff")
    f = lambda x, w: act.apply(x @ w, 1.5).sum()  # noqa: E731
    want = grads(lambda x, w: SiLUish.apply(x @ w, 1.5).sum(), x, w)
    monkeypatch.setattr(torch_opaque.config, "inductor_inline", False)
    got, code = compiled_code(f, x, w, backend="inductor")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert "opaque.IiSiLUOff_fwd" in code and "opaque.IiSiLUOff_bwd" in code


def test_export_graphs_keep_one_node(inputs):
    x, w = inputs
    act = wrapped(SiLUish, "IiSiLUExport")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(w.clone())

        def forward(self, x):
            return act.apply(x @ self.w, 1.5)

    ep = torch.export.export(M(), (x,))
    assert len(op_calls(ep.graph_module, "IiSiLUExport")) == 1
    assert len(op_calls(ep.run_decompositions().graph_module, "IiSiLUExport")) == 1
    step = torch_opaque.export_training(M(), (x,), loss=lambda y: y.sum())
    calls = op_calls(step.graph_module, "IiSiLUExport")
    assert sorted(str(n.target).split(".")[-2] for n in calls) == [
        "IiSiLUExport_bwd", "IiSiLUExport_fwd"]
    assert all(n.target in decomposition.select_decomp_table() for n in calls)  # Inductor's only


def test_table_entries_do_not_keep_a_dead_class_ops():
    """Note [Ops that graphs hold]: Inductor's tables are not a graph."""
    cls = wrapped(SiLUish, "IiSiLUDies")
    cls.apply(torch.randn(3), 1.0)
    (fwd,) = [op for op in decomposition.select_decomp_table() if "IiSiLUDies_fwd" in str(op)]
    name = str(fwd)
    del fwd
    ref = weakref.ref(cls)
    del cls
    gc.collect()
    assert ref() is None
    assert not any(str(op) == name for op in decomposition.select_decomp_table())
    assert not hasattr(torch.ops.opaque, "IiSiLUDies_fwd")


def _normalized(code: str, names) -> list:
    """Inductor's output without what differs between two compiles of the same
    graph: comments, hashes, paths, kernel names derived from the op's name."""
    import re

    for name in names:
        code = code.replace(name, "FN")
    code = re.sub(r"#.*", "", code)
    code = re.sub(r"/tmp/\S+", "", code)
    code = re.sub(r"\b[a-z0-9]{20,}\b", "H", code)
    return [line for line in code.splitlines() if line.strip()]


def test_generated_code_equals_the_stock_functions(inputs):
    """Issue #28: Inductor generates the same code for a wrapped Function as for
    the stock one (benchmarks/bench_compiled.py measures the speed)."""
    x, w = inputs
    stock_cls = type("IiSame", (SiLUish,), {})
    wrapped_cls = wrapped(SiLUish, "IiSameW")

    def f_of(cls):
        def f(x, w):
            h = cls.apply(x @ w, 1.5)
            return (cls.apply(h @ w, 0.5) * h).sum()

        return f

    want, stock_code = compiled_code(f_of(stock_cls), x, w, backend="inductor")
    got, code = compiled_code(f_of(wrapped_cls), x, w, backend="inductor")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    name = torch_opaque.lookup(wrapped_cls).name
    assert _normalized(code, [name, "IiSameW"]) == _normalized(stock_code, ["IiSame"])
