"""An op follows the autocast state it was called under, in eager code, torch.export
(``ep.module()``, ``run_decompositions``) and torch.compile (Note [Autocast in the
call] in torch_opaque/_impl/autocast_variant.py): values, dtypes and gradients
equal the stock Function's, with autocast entered inside the model or around it,
for an undecorated body, a ``custom_fwd(cast_inputs=...)`` one and a
setup_context one."""

import warnings

import pytest
import torch
from torch.amp import custom_bwd, custom_fwd

import torch_opaque
from support.autocast_steps import assert_same, step


class MatMul(torch.autograd.Function):  # undecorated: each op of the body autocasts
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t().to(g.dtype), (x.t().to(g.dtype) @ g).to(w.dtype)


class Float32MatMul(torch.autograd.Function):  # the AMP recipe for an fp32-only kernel
    @staticmethod
    @custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class ScaledMatMul(torch.autograd.Function):  # setup_context style, a float argument
    @staticmethod
    def forward(x, w, scale: float):
        return (x @ w) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, scale = inputs
        ctx.save_for_backward(x, w)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g * ctx.scale
        return g @ w.t().to(g.dtype), (x.t().to(g.dtype) @ g).to(w.dtype), None


def copy_of(cls):
    return type(cls.__name__, (cls,), {"__module__": "user_models"})


class Net(torch.nn.Module):
    def __init__(self, cls, inside=True):
        super().__init__()
        torch.manual_seed(0)
        self.cls, self.inside = cls, inside
        self.scaled = issubclass(cls, ScaledMatMul)
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def call(self, x):
        h = torch.nn.functional.linear(x, torch.eye(3))  # autocast: bfloat16 from here on
        if self.scaled:
            return self.cls.apply(h, self.w, 0.5) + 1
        return self.cls.apply(h, self.w) + 1

    def forward(self, x):
        if self.inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.call(x)
        return self.call(x)


FUNCTIONS = [MatMul, Float32MatMul, ScaledMatMul]
IDS = ["undecorated", "custom_fwd_cast_inputs", "setup_context"]


@pytest.mark.parametrize("cls", FUNCTIONS, ids=IDS)
def test_eager_and_export_follow_autocast_as_stock(cls):
    wrapped = torch_opaque.wrap(copy_of(cls))
    x = torch.randn(2, 3)
    stock, net = Net(cls), Net(wrapped)
    want = step(stock, x)
    assert want[0].dtype == (torch.float32 if cls is Float32MatMul else torch.bfloat16)
    assert_same(step(net, x), want)
    ep = torch.export.export(net, (x,), strict=False)
    assert_same(step(net, x, ep.module()), want)
    decomposed = ep.run_decompositions()
    targets = [str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"]
    variant = [t for t in targets if t.startswith("opaque.") and "_autocast" in t]
    assert len(variant) == 1, targets  # one opaque node, the autocast state in its arguments
    node = next(n for n in decomposed.graph.nodes if str(n.target) == variant[0])
    assert node.args[-1] == "cpu:torch.bfloat16"
    out = decomposed.module()(x)
    assert out.dtype == want[0].dtype
    torch.testing.assert_close(out, want[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("inside", [True, False], ids=["autocast_inside", "autocast_around"])
@pytest.mark.parametrize("cls", FUNCTIONS, ids=IDS)
def test_compiled_follows_autocast_as_stock(cls, inside):
    wrapped = torch_opaque.wrap(copy_of(cls))
    x = torch.randn(2, 3)
    stock = Net(cls, inside)
    want = step(stock, x, torch.compile(stock, backend="aot_eager"))
    net = Net(wrapped, inside)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch_opaque")  # nothing to warn about
        got = step(net, x, torch.compile(net, backend=backend, fullgraph=True))
    assert_same(got, want)
    assert any(str(n.target).startswith("opaque.") for n in graphs[0].graph.nodes)


def test_inductor_and_auto_keep_the_op_under_autocast():
    x = torch.randn(2, 3)
    want = step(Net(MatMul), x)
    cls = copy_of(MatMul)
    net = Net(cls)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch_opaque")
        with torch_opaque.auto() as report:
            got = step(net, x, torch.compile(net, backend="inductor", fullgraph=True))
    assert cls in report.ops and cls not in report.fallbacks
    assert_same(got, want)


def test_no_autocast_keeps_the_plain_op():
    wrapped = torch_opaque.wrap(copy_of(MatMul))
    ep = torch.export.export(Net(wrapped, inside=False), (torch.randn(2, 3),), strict=False)
    targets = [str(n.target) for n in ep.run_decompositions().graph.nodes]
    assert [t for t in targets if t.startswith("opaque.")] == [
        f"opaque.{torch_opaque.lookup(wrapped).name}.Tensor_Tensor"
    ]


def test_a_state_that_is_not_one_is_refused():
    from torch_opaque._impl.autocast_variant import entered

    with pytest.raises(ValueError, match="is not '<device type>:<dtype>'.*Pass the state the op's Autocast kernel records"):
        with entered("cpu:torch.notatype"):
            pass


class AddMatMulInPlace(torch.autograd.Function):  # x += a @ w, returning x and a @ w
    @staticmethod
    def forward(ctx, x, a, w):
        ctx.save_for_backward(a, w)
        ctx.mark_dirty(x)
        y = a @ w
        x.add_(y)
        return x, y

    @staticmethod
    def backward(ctx, gx, gy):
        a, w = ctx.saved_tensors
        g = gx + gy
        return gx, (g @ w.t().to(g.dtype)).to(a.dtype), (a.t().to(g.dtype) @ g).to(w.dtype)


class ScaleByMatMulInPlace(torch.autograd.Function):  # setup_context style, x only
    @staticmethod
    def forward(x, a, w):
        return x.mul_((a @ w).float())

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, a, w = inputs
        ctx.mark_dirty(x)
        ctx.save_for_backward(a, w)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        return g * (a @ w).float(), None, None


class InPlaceNet(torch.nn.Module):
    def __init__(self, cls):
        super().__init__()
        torch.manual_seed(0)
        self.cls = cls
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x, a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = x * 1.0  # not a leaf: the Function writes into it
            out = self.cls.apply(x, a, self.w)
            return tuple(o + 1 for o in out) if isinstance(out, tuple) else (out + 1,)


def in_place_step(model, run=None):
    model.zero_grad()
    torch.manual_seed(1)
    x, a = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    outs = (run if run is not None else model)(x, a)
    sum(o.float().sum() for o in outs).backward()
    return (*outs, x.grad, a.grad, model.w.grad)


@pytest.mark.parametrize("cls", [AddMatMulInPlace, ScaleByMatMulInPlace], ids=["forward", "setup_context"])
def test_in_place_functions_follow_autocast_as_stock(cls):
    wrapped = torch_opaque.wrap(copy_of(cls))
    want = in_place_step(InPlaceNet(cls))
    if cls is AddMatMulInPlace:
        assert want[1].dtype == torch.bfloat16  # a @ w autocasts
    net = InPlaceNet(wrapped)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch_opaque")  # nothing to warn about
        assert_same(in_place_step(net), want)
        ep = torch.export.export(net, (torch.randn(2, 4), torch.randn(2, 3)), strict=False)
        assert_same(in_place_step(net, ep.module()), want)
        decomposed = ep.run_decompositions()
        assert_same(in_place_step(net, decomposed.module()), want)
        assert_same(in_place_step(net, torch.compile(net, backend="aot_eager", fullgraph=True)), want)
    name = torch_opaque.lookup(wrapped).name
    ops = [str(n.args[0]).rsplit(".", 1)[0] for n in decomposed.graph.nodes
           if n.op == "call_function" and "auto_functionalized" in str(n.target)]
    assert ops == [f"opaque.{name}_autocast"], ops  # one node, the state in the call


_LOAD = """
import sys, torch, torch_opaque
ep = torch_opaque.load(sys.argv[1], allow=["autocast_saved_ops"])
x = torch.load(sys.argv[2])
out = ep.module()(x)
torch.save(out, sys.argv[3])
"""


def test_archives_of_autocast_calls_load_in_a_fresh_process(tmp_path, monkeypatch):
    import subprocess
    import sys

    import inspect

    # MatMul in a module of its own, which the loading process may import
    (tmp_path / "autocast_saved_ops.py").write_text("import torch\n\n\n" + inspect.getsource(MatMul))
    monkeypatch.syspath_prepend(str(tmp_path))
    import autocast_saved_ops

    cls = torch_opaque.wrap(autocast_saved_ops.MatMul)
    net = Net(cls)
    x = torch.randn(2, 3)
    want = net(x)
    ep = torch.export.export(net, (x,), strict=False).run_decompositions()
    torch_opaque.save(ep, tmp_path / "net.pt2")
    torch.save(x, tmp_path / "x.pt")
    subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "net.pt2"), str(tmp_path / "x.pt"),
         str(tmp_path / "out.pt")],
        check=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    got = torch.load(tmp_path / "out.pt")
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.detach())
