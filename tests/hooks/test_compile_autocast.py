"""torch.compile of an op called under torch.autocast (Note [Autocast while
tracing] in torch_opaque/_impl/autocast_check.py): the op does not follow
autocast in traced programs yet, so instead of a silently float32 result,
auto() runs that call as the stock Function (stock inlines the body: the
dtypes are stock's) and an explicitly wrapped class keeps its op with a
warning that says so. Eager calls follow autocast."""

import pytest
import torch

import torch_opaque


class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t().to(g.dtype), (x.t().to(g.dtype) @ g).to(w.dtype)


class Net(torch.nn.Module):
    def __init__(self, cls, inside=True):
        super().__init__()
        self.cls, self.inside = cls, inside
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        if self.inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.cls.apply(x.sin(), self.w) + 1
        return self.cls.apply(x.sin(), self.w) + 1


def copy_of(cls):
    return type(cls.__name__, (cls,), {"__module__": "user_models"})


def test_eager_follows_autocast_as_stock():
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    for _ in range(2):
        assert Net(torch_opaque.wrap(copy_of(MatMul)))(x).dtype == Net(MatMul)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_wrapped_class_under_autocast_keeps_its_op_and_says_so(backend):
    """AMP training with torch.compile keeps working with the op; its body runs in
    its inputs' dtypes there (float32 here, stock bfloat16), and a warning says so."""
    wrapped = torch_opaque.wrap(copy_of(MatMul))
    with pytest.warns(UserWarning) as caught:
        out = torch.compile(Net(wrapped), backend=backend, fullgraph=True)(torch.randn(2, 3))
    text = " ".join(str(w.message) for w in caught)
    assert "MatMul (the op opaque::" in text
    assert "is traced under torch.autocast('cpu', dtype=torch.bfloat16), which the op does not follow" in text
    assert "torch_opaque.auto()" in text
    assert out.dtype == torch.float32  # (stock: bfloat16)


@pytest.mark.parametrize("inside", [True, False], ids=["autocast_inside", "autocast_around"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_auto_falls_back_and_matches_stock_dtypes(backend, inside):
    torch.manual_seed(0)
    stock_net = Net(MatMul, inside)
    net = Net(copy_of(MatMul), inside)
    net.load_state_dict(stock_net.state_dict())
    x = torch.randn(2, 3)

    def run(model, under_auto):
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inside):
            if under_auto:
                with pytest.warns(UserWarning, match="traced under torch.autocast"):
                    with torch_opaque.auto() as report:
                        out = compiled(x)
                assert net.cls in report.fallbacks
                return out
            return compiled(x)

    ref = run(stock_net, False)
    torch._dynamo.reset()
    out = run(net, True)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    # that call only: outside autocast the class is still an op
    with torch_opaque.auto() as report:
        ep = torch.export.export(Net(net.cls, inside=False), (x,))
    assert net.cls in report.ops
    assert any("opaque" in str(n.target) for n in ep.graph.nodes)


def test_no_autocast_still_compiles_to_the_op():
    wrapped = torch_opaque.wrap(copy_of(MatMul))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    out = torch.compile(Net(wrapped, inside=False), backend=record, fullgraph=True)(torch.randn(2, 3))
    assert out.dtype == torch.float32
    assert any("opaque" in str(n.target) for n in graphs[0].graph.nodes)
