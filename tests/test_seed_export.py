"""Acceptance 1: the seed example keeps one op node on every export path."""

import pytest
import torch
import torch._dynamo

import torch_opaque
from conftest import aten_calls, op_calls


@torch_opaque.op(name="SeedFoo")
class Foo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def f(x):
    return Foo.apply(x)


class M(torch.nn.Module):
    def forward(self, x):
        return Foo.apply(x) * 2


def assert_one_opaque_node(gm):
    calls = op_calls(gm, "SeedFoo")
    assert len(calls) == 1, gm.code
    assert not aten_calls(gm, "sin"), gm.code
    assert "trampoline" not in gm.code
    return calls[0]


@pytest.mark.parametrize("aten_graph", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_dynamo_export(aten_graph, requires_grad):
    x = torch.randn([], requires_grad=requires_grad)
    gm, _ = torch._dynamo.export(f, aten_graph=aten_graph)(x)
    node = assert_one_opaque_node(gm)
    if not requires_grad or not aten_graph:
        assert node.target is torch.ops.opaque.SeedFoo.Tensor
    torch.testing.assert_close(gm(x), x.sin())


@pytest.mark.parametrize("strict", [True, False])
def test_torch_export(strict):
    x = torch.randn(3, requires_grad=True)
    ep = torch.export.export(M(), (x,), strict=strict)
    assert assert_one_opaque_node(ep.graph_module).target is torch.ops.opaque.SeedFoo.Tensor
    dec = ep.run_decompositions()
    assert assert_one_opaque_node(dec.graph_module).target is torch.ops.opaque.SeedFoo.Tensor
    y = torch.randn(3)
    torch.testing.assert_close(dec.module()(y), y.sin() * 2)


@pytest.mark.parametrize("strict", [True, False])
def test_torch_export_dynamic_batch(strict):
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(
        M(), (torch.randn(4, 3),), dynamic_shapes=({0: batch},), strict=strict
    )
    assert_one_opaque_node(ep.graph_module)
    dec = ep.run_decompositions()
    assert_one_opaque_node(dec.graph_module)
    node = op_calls(dec.graph_module, "SeedFoo")[0]
    # the op's output keeps the symbolic batch dimension
    assert isinstance(node.meta["val"].shape[0], torch.SymInt)
    for n in (2, 9):
        y = torch.randn(n, 3)
        torch.testing.assert_close(dec.module()(y), y.sin() * 2)


def test_export_program_serializes():
    ep = torch.export.export(M(), (torch.randn(3),))
    import io

    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert_one_opaque_node(loaded.graph_module)
    y = torch.randn(3)
    torch.testing.assert_close(loaded.module()(y), y.sin() * 2)
