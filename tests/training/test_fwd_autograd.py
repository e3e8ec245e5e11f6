"""Graphs that call `Name_fwd` on inputs requiring grad (torch._dynamo.export
with aten_graph=True) train with the Function's own backward, as stock does."""

import torch

import torch_opaque
from conftest import op_calls
from opaque_fixtures.archops import ScaledSin
from torch_opaque._impl.function import _ORIGINAL_APPLY


@torch_opaque.op
class StraightThroughRound(torch.autograd.Function):
    """A backward that is not the derivative of the forward (which is zero)."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return ScaledSin.apply(StraightThroughRound.apply(self.lin(x) * 3), 0.5)


def stock_net(net):
    def run(x):
        h = _ORIGINAL_APPLY(StraightThroughRound, net.lin(x) * 3)
        return _ORIGINAL_APPLY(ScaledSin, h, 0.5)

    return run


def test_dynamo_aten_graph_with_grad_trains_with_custom_backward():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4, requires_grad=True)
    gm, _ = torch._dynamo.export(net, aten_graph=True)(x)
    fwd_names = [n.target._schema.name for n in op_calls(gm, torch_opaque.lookup(ScaledSin).name)]
    assert fwd_names and all(name.endswith("_fwd") for name in fwd_names), gm.code

    gm(x).pow(2).sum().backward()
    ours = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    x.grad = None
    stock_net(net)(x).pow(2).sum().backward()
    ref = [p.grad for p in net.parameters()] + [x.grad]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert ref[-1].abs().sum() > 0  # the straight-through gradient reached x


def test_fwd_residuals_are_not_differentiable_and_values_match():
    x = torch.randn(3, requires_grad=True)
    out, residuals = _call_fwd(x)
    torch.testing.assert_close(out, x.detach().sin() * 2.0)
    assert out.requires_grad
    assert all(not r.requires_grad for r in residuals)
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, 2.0 * x.detach().cos())


def _call_fwd(x):
    name = torch_opaque.lookup(ScaledSin).name
    ScaledSin.apply(x.detach(), 2.0)  # defines the overload
    packet = getattr(torch.ops.opaque, name + "_fwd")
    (overload,) = [getattr(packet, o) for o in packet.overloads()]
    return overload(x, 2.0, [True, False])


def test_fwd_under_no_grad_records_nothing():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out, _ = _call_fwd(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, x.detach().sin() * 2.0)
