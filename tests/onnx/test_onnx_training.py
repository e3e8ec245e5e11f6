"""ONNX export of training programs (torch_opaque.export_training): custom-domain
Name_fwd / Name_bwd nodes whose model-local functions make onnxruntime compute
the loss and gradients of eager autograd, through the custom backwards."""

import numpy as np
import onnxruntime
import pytest
import torch

import torch_opaque
import torch_opaque.onnx
from torch_opaque.onnx import OnnxExportError
from test_onnx import SvdTop


@torch_opaque.op(name="OnnxTrainSignSTE")
class SignSTE(torch.autograd.Function):
    """Straight-through sign (clipped): autodiff of sign would give zero."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


@torch_opaque.op(name="OnnxTrainScaledExp")
class ScaledExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.exp(x) * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.exp(x) * ctx.scale, None


@torch_opaque.op(name="OnnxTrainMulTanh")
class MulTanh(torch.autograd.Function):
    """Two tensor inputs, a saved intermediate (a residual of Name_fwd)."""

    @staticmethod
    def forward(ctx, a, b):
        t = torch.tanh(a * b)
        ctx.save_for_backward(a, b, t)
        return t

    @staticmethod
    def backward(ctx, g):
        a, b, t = ctx.saved_tensors
        d = g * (1 - t * t)
        return d * b, d * a


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = torch.nn.Linear(4, 6)
        self.lin2 = torch.nn.Linear(6, 2)
        self.gate = torch.nn.Parameter(torch.randn(6))

    def forward(self, x, target):
        h = SignSTE.apply(self.lin1(x))
        h = MulTanh.apply(ScaledExp.apply(h * 0.5, 1.5), self.gate)
        return torch.nn.functional.mse_loss(self.lin2(h), target)


def eager_step(model, *args):
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def custom(proto):
    return sorted(n.op_type for n in proto.graph.node if n.domain == "opaque")


def run_ort(proto, *args):
    sess = onnxruntime.InferenceSession(proto.SerializeToString())
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: a.numpy() for n, a in zip(names, args)})


def assert_equal_eager(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_onnxruntime_computes_the_loss_and_gradients_of_eager_autograd(dynamic):
    net = Net()
    batch = torch.export.Dim("batch", min=2)
    step = torch_opaque.export_training(
        net, (torch.randn(5, 4), torch.randn(5, 2)),
        dynamic_shapes=({0: batch}, {0: batch}) if dynamic else None,
    )
    proto = torch_opaque.onnx.export(step)
    roles = ["OnnxTrainMulTanh", "OnnxTrainScaledExp", "OnnxTrainSignSTE"]
    assert custom(proto) == sorted(f"{n}_{r}" for n in roles for r in ("fwd", "bwd"))
    bodies = {f.name: [n.op_type for n in f.node] for f in proto.functions}
    assert "Sign" in bodies["OnnxTrainSignSTE_fwd"]
    assert "Abs" in bodies["OnnxTrainSignSTE_bwd"]  # the custom backward, not autodiff
    assert len(proto.graph.output) == len(torch_opaque.training_outputs(step)) == 6
    for n in (5, 9) if dynamic else (5,):
        x, t = torch.randn(n, 4), torch.randn(n, 2)
        got = run_ort(proto, x, t)
        assert_equal_eager(got, eager_step(net, x, t))
    assert np.abs(got[1]).sum() > 0  # the straight-through gradient reached lin1


def test_functions_false_gives_bare_training_nodes():
    step = torch_opaque.export_training(Net(), (torch.randn(5, 4), torch.randn(5, 2)))
    proto = torch_opaque.onnx.export(step, functions=False)
    assert "OnnxTrainScaledExp_bwd" in custom(proto)
    assert [f.name for f in proto.functions if f.domain == "opaque"] == []
    bwd = next(n for n in proto.graph.node if n.op_type == "OnnxTrainScaledExp_bwd")
    attrs = {a.name: a for a in bwd.attribute}
    assert list(attrs["needs_input_grad"].ints) == [1, 0]
    assert "1.5" in attrs["state"].s.decode()


def test_mapping_an_op_of_a_training_program_is_refused():
    step = torch_opaque.export_training(Net(), (torch.randn(5, 4), torch.randn(5, 2)))
    with pytest.raises(OnnxExportError) as info:
        torch_opaque.onnx.export(step, mapping={ScaledExp: "Exp"})
    assert str(info.value).startswith(
        "torch_opaque.onnx: mapping names opaque::OnnxTrainScaledExp, but this training program"
    )


class SvdNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return SvdTop.apply(x @ self.w).sum()


def test_training_forward_without_onnx_translation_names_the_function_and_the_ways_out():
    step = torch_opaque.export_training(SvdNet(), (torch.randn(3, 3),))
    with pytest.raises(OnnxExportError) as info:
        torch_opaque.onnx.export(step)
    msg = str(info.value)
    assert msg.startswith(
        "torch_opaque.onnx: the forward of opaque::OnnxSvdTop (SvdTop) has no ONNX "
        "translation ("
    ), msg
    assert "aten._linalg_svd" in msg and "functions=False" in msg and "mapping=" in msg
    proto = torch_opaque.onnx.export(step, functions=False)
    assert custom(proto) == ["OnnxSvdTop_bwd", "OnnxSvdTop_fwd"]


def test_an_ordinary_exported_program_still_exports():
    class M(torch.nn.Module):
        def forward(self, x):
            return ScaledExp.apply(x, 2.0) + 1

    ep = torch.export.export(M(), (torch.randn(4, 3),))
    proto = torch_opaque.onnx.export(ep)
    assert custom(proto) == ["OnnxTrainScaledExp"]
    x = torch.randn(4, 3)
    (y,) = run_ort(proto, x)
    np.testing.assert_allclose(y, M()(x).numpy(), rtol=1e-6, atol=1e-6)
