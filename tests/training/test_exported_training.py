"""Acceptance 3: ep.module() of an exported program trains with the custom backward."""

import pytest
import torch

import torch_opaque
from conftest import op_calls


@torch_opaque.op(name="ScaledTanh")
class ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (ctx.scale - y * y / ctx.scale), None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(ScaledTanh.apply(self.a(x), 1.5))


def param_grads(module, x, target):
    module.zero_grad()
    loss = torch.nn.functional.mse_loss(module(x), target)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}, loss.detach()


@pytest.mark.parametrize("strict", [False, True])
def test_exported_module_gradients_equal_eager(strict):
    torch.manual_seed(0)
    net = Net()
    ep = torch.export.export(
        net, (torch.randn(4, 6),), dynamic_shapes=({0: torch.export.Dim("b")},), strict=strict
    )
    assert len(op_calls(ep.graph_module, "ScaledTanh")) == 1
    x, target = torch.randn(7, 6), torch.randn(7, 3)
    ref_grads, ref_loss = param_grads(net, x, target)
    mod = ep.module()
    grads, loss = param_grads(mod, x, target)
    torch.testing.assert_close(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name])


def test_exported_module_trains_and_loss_decreases():
    torch.manual_seed(1)
    mod = torch.export.export(Net(), (torch.randn(4, 6),)).module()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    x, target = torch.randn(4, 6), torch.randn(4, 3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mod(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8


def test_decomposed_program_still_trains():
    torch.manual_seed(2)
    net = Net()
    ep = torch.export.export(net, (torch.randn(4, 6),)).run_decompositions()
    assert len(op_calls(ep.graph_module, "ScaledTanh")) == 1
    x, target = torch.randn(4, 6), torch.randn(4, 3)
    ref, _ = param_grads(net, x, target)
    got, _ = param_grads(ep.module(), x, target)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name])
