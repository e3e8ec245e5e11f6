"""Backwards with data-dependent sizes inside (boolean-mask indexing) whose
gradients have the inputs' shapes: the fake of ``Name_bwd`` leaves no unbacked
symbol pending and needs no dynamic-output-shape support (make_backward_fake
in torch_opaque/_impl/kernels.py, Note [Fake from a real run])."""

import math
import warnings

import pytest
import torch

import torch_opaque
from conftest import op_calls


# ---- surrogate gradients, as snntorch writes them (snntorch/surrogate.py) --------


class Heaviside(torch.autograd.Function):
    """Default spiking function for neuron: straight-through, zero below threshold."""

    @staticmethod
    def forward(ctx, input_):
        out = (input_ > 0).float()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (out,) = ctx.saved_tensors
        grad = grad_output * out
        return grad


class StraightThroughMasked(torch.autograd.Function):
    """Heaviside forward; the gradient is cut where the input is negative."""

    @staticmethod
    def forward(ctx, input_):
        ctx.save_for_backward(input_)
        out = (input_ > 0).float()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = grad_input.clone()
        grad[input_ < 0] = 0
        return grad


class ATan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, alpha=2.0):
        ctx.save_for_backward(input_)
        ctx.alpha = alpha
        out = (input_ > 0).float()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = (
            ctx.alpha
            / 2
            / (1 + (math.pi / 2 * ctx.alpha * input_).pow_(2))
            * grad_input
        )
        grad[input_ < -1] = 0
        return grad, None


class FastSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, slope=25):
        ctx.save_for_backward(input_)
        ctx.slope = slope
        out = (input_ > 0).float()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = grad_input / (ctx.slope * torch.abs(input_) + 1.0) ** 2
        return grad, None


class Triangular(torch.autograd.Function):
    """Masked read and write: ``g[x >= 0] = -g[x >= 0]`` (nonzero inside)."""

    @staticmethod
    def forward(ctx, input_, threshold=1):
        ctx.save_for_backward(input_)
        ctx.threshold = threshold
        out = (input_ > 0).float()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = grad_input * ctx.threshold
        grad[input_ >= 0] = -grad[input_ >= 0]
        return grad, None


SURROGATES = [StraightThroughMasked, ATan, FastSigmoid, Triangular, Heaviside]


class SpikingLayer(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        return self.fn.apply(self.fc(x)).sum(-1)


def _step(model, x):
    """One training step's gradients: inputs and parameters."""
    x = x.clone().requires_grad_()
    model.zero_grad()
    loss = (model(x) * torch.arange(1.0, x.shape[0] + 1)).sum()
    loss.backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


def _fresh(C):
    return type(C.__name__, (C,), {})


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("C", SURROGATES, ids=lambda c: c.__name__)
def test_compiled_training_step_matches_stock(C, backend):
    W = torch_opaque.wrap(_fresh(C))
    x = torch.randn(4, 6)
    want = _step(SpikingLayer(C), x)
    model = SpikingLayer(W)
    got = _step(torch.compile(model, backend=backend), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("C", [StraightThroughMasked, Triangular], ids=lambda c: c.__name__)
def test_compiled_training_step_with_dynamic_batch(C):
    W = torch_opaque.wrap(_fresh(C))
    model = torch.compile(SpikingLayer(W), backend="aot_eager", dynamic=True)
    for n in (3, 7):
        x = torch.randn(n, 6)
        want = _step(SpikingLayer(C), x)
        for a, b in zip(_step(model, x), want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("C", [StraightThroughMasked, ATan, Triangular], ids=lambda c: c.__name__)
def test_auto_compiled_training_step_matches_stock(C):
    C = _fresh(C)
    x = torch.randn(4, 6)
    want = _step(SpikingLayer(C), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back
        with torch_opaque.auto() as report:
            got = _step(torch.compile(SpikingLayer(C), backend="aot_eager"), x)
    assert C in report.ops
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_compiled_training_graph_keeps_the_custom_backward():
    W = torch_opaque.wrap(_fresh(Triangular))
    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        from functorch.compile import make_boxed_func

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    _step(torch.compile(SpikingLayer(W), backend=backend), torch.randn(4, 6))
    name = torch_opaque.lookup(W).name
    assert [n.target._schema.name for g in graphs for n in op_calls(g, name)] == [
        f"opaque::{name}_fwd",
        f"opaque::{name}_bwd",
    ]


@pytest.mark.parametrize("C", [StraightThroughMasked, Triangular], ids=lambda c: c.__name__)
def test_export_then_train_the_exported_module(C):
    W = torch_opaque.wrap(_fresh(C))
    x = torch.randn(4, 6)
    ep = torch.export.export(SpikingLayer(W), (x,))
    assert len(op_calls(ep, torch_opaque.lookup(W).name)) == 1
    stock = SpikingLayer(C)
    xr = x.clone().requires_grad_()
    xs = x.clone().requires_grad_()
    ep.module()(xr).sum().backward()
    stock(xs).sum().backward()
    torch.testing.assert_close(xr.grad, xs.grad)


@pytest.mark.parametrize("C", [StraightThroughMasked, Triangular], ids=lambda c: c.__name__)
def test_exported_training_step_matches_stock(C):
    W = torch_opaque.wrap(_fresh(C))
    batch = torch.export.Dim("batch")
    step = torch_opaque.export_training(
        SpikingLayer(W), (torch.randn(4, 6),), loss=lambda y: y.pow(2).sum(),
        dynamic_shapes=({0: batch},),
    )
    name = torch_opaque.lookup(W).name
    assert {n.target._schema.name for n in op_calls(step, name)} == {
        f"opaque::{name}_fwd", f"opaque::{name}_bwd"}
    stock = SpikingLayer(C)
    for n in (4, 9):
        x = torch.randn(n, 6)
        loss, *grads = step.module()(x)
        stock.zero_grad()
        want_loss = stock(x).pow(2).sum()
        want_loss.backward()
        torch.testing.assert_close(loss, want_loss.detach())
        for g, p in zip(grads, stock.parameters()):
            torch.testing.assert_close(g, p.grad)


def test_backward_whose_gradient_shape_depends_on_the_data_is_refused():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g[x > 0]

    W = torch_opaque.wrap(Bad)
    x = torch.randn(6, requires_grad=True)
    with pytest.raises(Exception) as info:
        torch.compile(lambda t: W.apply(t).sum(), backend="aot_eager")(x).backward()
    msg = str(info.value)
    assert "Bad.backward cannot run on fake tensors while tracing a training graph" in msg
    assert "depends on the data" in msg
