"""torch_opaque.export_training: a training step (loss and gradients) exported
with each Function's custom backward as an opaque Name_bwd node, compared with
eager autograd on the same model."""

import pytest
import torch

import torch_opaque
from conftest import op_calls


@torch_opaque.op(name="TrainRoundSTE")
class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: autodiff of the forward would give zero."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, g):
        return g, None


@torch_opaque.op(name="TrainScaledSin")
class ScaledSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.sin() * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.scale, None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 6)
        self.lin2 = torch.nn.Linear(6, 2)

    def forward(self, x, target):
        h = RoundSTE.apply(self.lin1(x), 4.0)
        y = self.lin2(ScaledSin.apply(h, 1.5))
        return torch.nn.functional.mse_loss(y, target)


def eager_step(model, *args):
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def test_loss_and_gradients_equal_eager_with_the_custom_backward_dynamic_batch():
    torch.manual_seed(0)
    net = Net()
    batch = torch.export.Dim("batch")
    step = torch_opaque.export_training(
        net, (torch.randn(5, 4), torch.randn(5, 2)), dynamic_shapes=({0: batch}, {0: batch})
    )
    assert torch_opaque.training_outputs(step) == [
        "loss", "lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias"
    ]
    for name in ("TrainRoundSTE", "TrainScaledSin"):
        roles = sorted(str(n.target).split(".")[1] for n in op_calls(step.graph, name))
        assert roles == [f"{name}_bwd", f"{name}_fwd"], roles
    for n in (5, 11):
        x, t = torch.randn(n, 4), torch.randn(n, 2)
        got = step.module()(x, t)
        want = eager_step(net, x, t)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    # The straight-through gradient reached lin1 (autodiff of round gives zero).
    assert got[1].abs().sum() > 0


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        return ScaledSin.apply(x * self.w, 2.0)


def test_loss_callable_and_gradients_of_inputs_that_require_grad():
    model = Plain()
    x = torch.randn(4, 3, requires_grad=True)
    mse = torch.nn.MSELoss(reduction="sum")  # a loss module: not added to the model
    step = torch_opaque.export_training(model, (x,), loss=lambda y: mse(y, torch.zeros_like(y)))
    assert torch_opaque.training_outputs(step) == ["loss", "w", "input:x"]
    assert list(dict(model.named_modules())) == [""]
    loss, gw, gx = step.module()(x)
    x2 = x.detach().clone().requires_grad_()
    ref = ScaledSin.apply(x2 * model.w, 2.0).pow(2).sum()
    rw, rx = torch.autograd.grad(ref, (model.w, x2))
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gx, rx)


def test_a_step_that_does_not_return_a_scalar_loss_is_refused():
    with pytest.raises(torch_opaque.UnsupportedError) as info:
        torch_opaque.export_training(Plain(), (torch.randn(4, 3),))
    assert str(info.value) == (
        "torch_opaque.export_training: the exported step must return one scalar loss, but the "
        "model returned 1 output(s) of shape (4, 3). Return a scalar (e.g. `.mean()`), or pass "
        "loss=<outputs -> scalar>."
    )


def test_auto_mode_functions_travel_too():
    class Cube(torch.autograd.Function):  # not decorated: auto() wraps it
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return Cube.apply(x * self.w).sum()

    m, x = M(), torch.randn(2, 3)
    with torch_opaque.auto():
        step = torch_opaque.export_training(m, (x,))
    assert any("Cube" in str(n.target) and "_bwd" in str(n.target) for n in step.graph.nodes)
    loss, gw = step.module()(x)
    torch.testing.assert_close(gw, (3 * (x * m.w) ** 2 * x).sum(0).detach())
