"""torch.fx.symbolic_trace of modules calling wrapped Functions (Note [FX symbolic tracing]).

Stock symbolic_trace inlines a Function's forward, so the GraphModule
differentiates the forward's operations (a straight-through estimator's
gradient becomes zeros). A wrapped class is recorded as one node of its op,
and the GraphModule's values and gradients equal the stock Function's eager ones.
"""

import io
import operator
import re
import warnings

import pytest
import torch

import torch_opaque
from torch_opaque.errors import SchemaError, UnsupportedError

from conftest import op_calls


class STE(torch.autograd.Function):
    """A straight-through estimator as quantisation packages write it (no hints)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class AnnotatedSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clamp(-1, 1)


class Quantize(torch.autograd.Function):
    """Non-tensor arguments: float, int, bool, None, a tuple of ints."""

    @staticmethod
    def forward(ctx, x, scale, bits, symmetric, offset, dims):
        ctx.scale, ctx.dims = scale, dims
        q = torch.round(x / scale).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        if offset is not None:
            q = q + offset
        if not symmetric:
            q = q.abs()
        return q * scale

    @staticmethod
    def backward(ctx, g):
        return g * 2.0, None, None, None, None, None


class SinCos(torch.autograd.Function):
    """Two outputs, one saved input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, ga, gb):
        (x,) = ctx.saved_tensors
        return ga * x.cos() - gb * x.sin() + 1.0  # "+ 1": a custom gradient, not autograd's


class Rows(torch.autograd.Function):
    """An int argument that the caller takes from x.shape (no hints)."""

    @staticmethod
    def forward(ctx, x, n):
        return torch.round(x.reshape(n, -1))

    @staticmethod
    def backward(ctx, g):
        return g.reshape(-1), None


class AnnotatedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        ctx.shape = x.shape
        return torch.round(x.reshape(n, -1))

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape) * 3.0, None


class Branchy(torch.autograd.Function):
    """A forward whose Python control flow reads tensor values."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x) if bool(x.sum() > 0) else -torch.round(-x)

    @staticmethod
    def backward(ctx, g):
        return g


def wrapped(cls):
    return torch_opaque.wrap(type(cls.__name__ + "W", (cls,), {}))


class Call(torch.nn.Module):
    def __init__(self, fn, *extra):
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, x):
        out = self.fn.apply(x * 1.5, *self.extra)
        return tuple(o + 1 for o in out) if isinstance(out, tuple) else out + 1


def assert_like_stock(gm, cls, *extra, x=None):
    x = torch.randn(2, 6, requires_grad=True) if x is None else x
    x2 = x.detach().clone().requires_grad_()
    want = cls.apply(x * 1.5, *extra)
    want = tuple(w + 1 for w in want) if isinstance(want, tuple) else want + 1
    got = gm(x2)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    sum(w.sum() for w in want).backward()
    sum(g.sum() for g in got).backward()
    torch.testing.assert_close(x2.grad, x.grad)


def the_op(gm, cls):
    nodes = op_calls(gm, torch_opaque.lookup(cls).name)
    assert len(nodes) == 1, gm.code
    return nodes[0]


@pytest.mark.parametrize("base", [STE, AnnotatedSTE])
def test_straight_through_estimator_keeps_its_gradient(base):
    W = wrapped(base)
    stock_gm = torch.fx.symbolic_trace(Call(base))
    gm = torch.fx.symbolic_trace(Call(W))
    node = the_op(gm, W)
    fn = torch_opaque.lookup(W)
    assert node.target is getattr(getattr(torch.ops.opaque, fn.name), node.target._overloadname)
    assert not [n for n in gm.graph.nodes if n.target in (torch.round, torch.sign)]
    assert_like_stock(gm, base)
    # what the issue reports: stock's GraphModule differentiates round / sign
    x = torch.randn(2, 6, requires_grad=True)
    stock_gm(x).sum().backward()
    assert torch.count_nonzero(x.grad) == 0


def test_overload_defined_by_an_eager_call_is_the_one_traced():
    W = wrapped(Quantize)
    extra = (0.25, 4, False, None, (0, 1))
    W.apply(torch.randn(3), *extra)
    (name,) = torch_opaque.lookup(W).overloads
    gm = torch.fx.symbolic_trace(Call(W, *extra))
    assert the_op(gm, W).target._overloadname == name
    assert len(torch_opaque.lookup(W).overloads) == 1
    assert_like_stock(gm, Quantize, *extra)


@pytest.mark.parametrize(
    "extra", [(0.25, 4, False, None, (0, 1)), (0.5, 8, True, 1.0, ()), (1.0, 2, True, None, (1,))]
)
def test_non_tensor_arguments_without_an_eager_call(extra):
    W = wrapped(Quantize)
    gm = torch.fx.symbolic_trace(Call(W, *extra))
    node = the_op(gm, W)
    assert list(node.args[1:]) == list(extra)
    assert torch_opaque.lookup(W).overloads[node.target._overloadname].n_out == 1
    assert_like_stock(gm, Quantize, *extra)
    # an eager call of the same kinds uses the overload the trace defined
    W.apply(torch.randn(3), *extra)
    assert list(torch_opaque.lookup(W).overloads) == [node.target._overloadname]


def test_several_outputs_are_getitem_nodes_of_one_op_node():
    W = wrapped(SinCos)
    gm = torch.fx.symbolic_trace(Call(W))
    node = the_op(gm, W)
    users = sorted(node.users, key=lambda n: n.args[1])
    assert [(u.target, u.args[1]) for u in users] == [(operator.getitem, 0), (operator.getitem, 1)]
    assert_like_stock(gm, SinCos)


def test_proxy_for_a_size_needs_an_annotation():
    W = wrapped(Rows)

    class M(torch.nn.Module):
        def forward(self, x):
            return W.apply(x, x.shape[0])

    with pytest.raises(SchemaError) as e:
        torch.fx.symbolic_trace(M())
    msg = str(e.value)
    assert "argument 'n' is a torch.fx Proxy for a value that is not a tensor (x.shape[0])" in msg
    assert "'n: int'" in msg and "concrete_args" in msg and "torch.export" in msg


def test_annotated_int_argument_takes_the_traced_size():
    W = wrapped(AnnotatedRows)

    class M(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn.apply(x, x.shape[0] // 2)

    gm = torch.fx.symbolic_trace(M(W))
    node = the_op(gm, W)
    assert isinstance(node.args[1], torch.fx.Node)  # the size, computed when the module runs
    for shape in [(4, 3), (6, 5)]:
        x = torch.randn(shape, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want = M(AnnotatedRows)(x)
        got = gm(x2)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)


def test_forward_that_cannot_run_on_proxies_asks_for_a_return_hint_or_an_eager_call():
    W = wrapped(Branchy)
    with pytest.raises(SchemaError, match=r"cannot tell how many tensors .* Annotate forward's return"):
        torch.fx.symbolic_trace(Call(W))
    W.apply(torch.randn(3))  # an eager call defines the overload
    gm = torch.fx.symbolic_trace(Call(W))
    the_op(gm, W)
    assert_like_stock(gm, Branchy)


def test_in_place_function_is_refused():
    class AddOne(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.add_(1)

        @staticmethod
        def backward(ctx, g):
            return g

    W = wrapped(AddOne)
    with pytest.raises(UnsupportedError, match=r"mark_dirty.*torch.export"):
        torch.fx.symbolic_trace(Call(W))


def test_recompile_print_readable_and_torch_save():
    W = wrapped(SinCos)
    gm = torch.fx.symbolic_trace(Call(W))
    name = the_op(gm, W).target
    gm.recompile()
    text = gm.print_readable(print_output=False)
    assert f"torch.ops.opaque.{torch_opaque.lookup(W).name}.{name._overloadname}(" in text
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    the_op(loaded, W)
    assert_like_stock(loaded, SinCos)


def test_auto_records_the_op():
    class AutoSTE(STE):
        pass

    with torch_opaque.auto(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        gm = torch.fx.symbolic_trace(Call(AutoSTE))
    the_op(gm, AutoSTE)
    assert_like_stock(gm, STE)


def test_auto_with_eager_call_first_and_non_tensor_arguments():
    class AutoQuantize(Quantize):
        pass

    extra = (0.25, 4, False, None, (0, 1))
    with torch_opaque.auto():
        AutoQuantize.apply(torch.randn(3), *extra)
        gm = torch.fx.symbolic_trace(Call(AutoQuantize, *extra))
    the_op(gm, AutoQuantize)
    assert len(torch_opaque.lookup(AutoQuantize).overloads) == 1
    assert_like_stock(gm, Quantize, *extra)


def test_auto_falls_back_to_stock_tracing_for_a_size_argument():
    class AutoRows(Rows):
        pass

    class M(torch.nn.Module):
        def forward(self, x):
            return AutoRows.apply(x, x.shape[0])

    with torch_opaque.auto(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = torch.fx.symbolic_trace(M())
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(r"AutoRows.*not a tensor \(x.shape\[0\]\)", t) for t in texts), texts
    assert any("AutoRows is traced as an ordinary autograd.Function" in t for t in texts), texts
    assert not op_calls(gm, "AutoRows") and [n for n in gm.graph.nodes if n.target is torch.round]
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), Rows.apply(x, 2))


class SetupStyle(torch.autograd.Function):
    """forward without ctx, setup_context separate (torch >= 2.0 style)."""

    @staticmethod
    def forward(x, k):
        return torch.floor(x) * k, x.abs()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, ga, gb):
        return ga * ctx.k + gb, None


def test_setup_context_style_without_an_eager_call():
    W = wrapped(SetupStyle)
    gm = torch.fx.symbolic_trace(Call(W, 0.5))
    node = the_op(gm, W)
    assert torch_opaque.lookup(W).overloads[node.target._overloadname].n_out == 2
    assert_like_stock(gm, SetupStyle, 0.5)
