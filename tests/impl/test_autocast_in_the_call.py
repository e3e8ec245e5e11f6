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


def step(model, x, run=None):
    """Output and gradients (input, weight) of one forward/backward, autocast
    entered around the call when the model does not enter it itself."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not model.inside):
        out = (run if run is not None else model)(x)
    out.float().sum().backward()
    return out, x.grad, model.w.grad


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)


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

    with pytest.raises(ValueError, match="is not '<device type>:<dtype>'"):
        with entered("cpu:torch.notatype"):
            pass


def test_in_place_functions_still_say_they_do_not_record_it():
    # Note [Autocast while tracing]: an in-place Function has no autocast variant yet
    @torch_opaque.op(name="AutocastDoubleInPlace")
    class DoubleInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.mul_(2)

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, torch.eye(3))
            return DoubleInPlace.apply(h)

    with pytest.warns(UserWarning, match="which the op does not follow in traced programs"):
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(2, 3))
    assert out.dtype == torch.bfloat16
