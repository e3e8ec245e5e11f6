"""Double backward (create_graph=True) through wrapped Functions, against the
same Functions unwrapped: the gradients a wrapped backward returns are
differentiable through the operations the backward is written with."""

import pytest
import torch
from torch.autograd.function import once_differentiable

import torch_opaque
from conftest import op_calls
from opaque_fixtures.archops import Cube, MulAdd, ScaledSin
from torch_opaque._impl.function import _ORIGINAL_APPLY


def original(cls, *args):
    return _ORIGINAL_APPLY(cls, *args)


@torch_opaque.op
class Tanh(torch.autograd.Function):
    """Saves its output: the second derivative goes through the op's own node."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


@torch_opaque.op
class OnceSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def dbl(*shape):
    return torch.randn(*shape, dtype=torch.double, requires_grad=True)


def test_gradgradcheck_saved_output():
    assert torch.autograd.gradgradcheck(Tanh.apply, (dbl(4),))


def test_gradgradcheck_ctx_attribute():
    assert torch.autograd.gradgradcheck(lambda x: ScaledSin.apply(x, 1.5), (dbl(4),))


def hvp(apply, x, v):
    """Hessian-vector product of sum(apply(x)) by double backward."""
    (g,) = torch.autograd.grad(apply(x).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g, x, v)
    return g, h


@pytest.mark.parametrize("cls", [Cube, Tanh])
def test_hessian_vector_product_equals_stock(cls):
    x, v = dbl(5), torch.randn(5, dtype=torch.double)
    g, h = hvp(cls.apply, x, v)
    rg, rh = hvp(lambda t: original(cls, t), x, v)
    assert g.requires_grad and g.grad_fn is not None
    torch.testing.assert_close(g, rg)
    torch.testing.assert_close(h, rh)


def test_hessian_equals_stock():
    x = torch.randn(3, dtype=torch.double)
    f = lambda t: ScaledSin.apply(t, 0.5).sum() + Tanh.apply(t * 2).pow(2).sum()  # noqa: E731
    r = lambda t: (  # noqa: E731
        original(ScaledSin, t, 0.5).sum() + original(Tanh, t * 2).pow(2).sum()
    )
    torch.testing.assert_close(
        torch.autograd.functional.hessian(f, x), torch.autograd.functional.hessian(r, x)
    )


def gradient_penalty_grads(apply, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(6, 4, dtype=torch.double, requires_grad=True)
    out = apply(lin(x))
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = out.pow(2).mean() + gx.pow(2).sum()
    loss.backward()
    return [p.grad for p in lin.parameters()] + [x.grad]


def test_gradient_penalty_equals_stock():
    ours = gradient_penalty_grads(Tanh.apply)
    ref = gradient_penalty_grads(lambda t: original(Tanh, t))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_two_outputs_and_a_residual_in_double_backward():
    # MulAdd saves an intermediate (tanh of the product): stock differentiates
    # through it as a constant, and so must the op.
    a, b = dbl(2, 3), dbl(2, 3)

    def second(apply):
        s, t = apply(a, b)
        ga, gb = torch.autograd.grad((s * t).sum(), (a, b), create_graph=True)
        return torch.autograd.grad((ga * ga).sum() + gb.sum(), (a, b))

    for ours, ref in zip(second(MulAdd.apply), second(lambda *x: original(MulAdd, *x))):
        torch.testing.assert_close(ours, ref)


def double_backward_error(apply, grad_out_requires_grad):
    x = dbl(3)
    v = torch.ones(3, dtype=torch.double, requires_grad=grad_out_requires_grad)
    (g,) = torch.autograd.grad(apply(x), x, v, create_graph=True)
    torch.testing.assert_close(g, 2 * x.detach())
    with pytest.raises(RuntimeError) as info:
        g.sum().backward()
    return str(info.value)


@pytest.mark.parametrize("grad_out_requires_grad", [False, True])
def test_once_differentiable_fails_as_stock(grad_out_requires_grad):
    ours = double_backward_error(OnceSquare.apply, grad_out_requires_grad)
    ref = double_backward_error(lambda t: original(OnceSquare, t), grad_out_requires_grad)
    assert ours == ref
    if grad_out_requires_grad:
        assert "marked with @once_differentiable" in ours


def test_first_order_backward_records_nothing():
    x = dbl(3)
    (g,) = torch.autograd.grad(Tanh.apply(x).sum(), x)
    assert not g.requires_grad


class TanhModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return Tanh.apply(self.lin(x)) + Cube.apply(x)  # Cube: a custom backward


@pytest.mark.parametrize("strict", [True, False])
def test_exported_program_module_double_backward(strict):
    torch.manual_seed(0)
    model = TanhModel()
    ep = torch.export.export(model, (torch.randn(2, 3, dtype=torch.double),), strict=strict)
    assert len(op_calls(ep.graph_module, torch_opaque.lookup(Tanh).name)) == 1
    x, v = dbl(2, 3), torch.randn(2, 3, dtype=torch.double)

    def second(fn):
        (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        return torch.autograd.grad((g * v).sum(), x)

    ref = second(lambda t: original(Tanh, model.lin(t)) + original(Cube, t))
    torch.testing.assert_close(second(ep.module()), ref)


class PenaltyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return ScaledSin.apply(self.lin(x), 1.5).pow(2).sum()


def test_training_program_gradients_are_differentiable():
    """The input gradient an export_training program returns (Name_fwd and
    Name_bwd nodes run by ep.module()) can be differentiated again."""
    torch.manual_seed(0)
    model = PenaltyModel()
    x = dbl(2, 3)
    ep = torch_opaque.export_training(model, (x,))
    names = {n.target._schema.name for n in op_calls(ep.graph_module, "ArchScaledSin")}
    assert names == {"opaque::ArchScaledSin_fwd", "opaque::ArchScaledSin_bwd"}
    gx = ep.module()(x)[-1]
    (ours,) = torch.autograd.grad(gx.pow(2).sum(), x)

    y = original(ScaledSin, model.lin(x), 1.5).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    (ref,) = torch.autograd.grad(g.pow(2).sum(), x)
    torch.testing.assert_close(ours, ref)
