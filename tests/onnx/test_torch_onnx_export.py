"""``torch.onnx.export(model, args, dynamo=True)``, the exporter users already
call, on models holding opaque ops, with no extra argument (Note [torch.onnx.export
of opaque ops] in torch_opaque/onnx/torch_onnx_export.py): compared with the same
model calling the stock Function, in onnxruntime."""

import numpy as np
import onnxruntime
import pytest
import torch
from onnxscript import opset18 as op

import torch_opaque
import torch_opaque.onnx
from torch_opaque.onnx import registry as onnx_registry

from test_onnx import SvdTop


def make_functions():
    """Fresh Function classes, the way packages write them: an STE with a float
    on ctx, and one with two outputs."""

    class ClippedSTE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, limit: float = 1.0):
            ctx.save_for_backward(x)
            ctx.limit = limit
            return torch.sign(x) * limit

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * (x.abs() <= ctx.limit), None

    class SplitTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return torch.tanh(x) * y, x - y

        @staticmethod
        def backward(ctx, ga, gb):
            return ga + gb, ga - gb

    return ClippedSTE, SplitTanh


class Net(torch.nn.Module):
    def __init__(self, ste, split):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.ste, self.split = ste, split

    def forward(self, x):
        h = self.ste.apply(self.lin(x), 0.5)
        a, b = self.split.apply(h, x)
        return a + 1, b


def run_ort(program, *args):
    sess = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: a.numpy() for n, a in zip(names, args)})


def test_torch_onnx_export_runs_in_onnxruntime_as_the_stock_function_does():
    # The ops get defined inside torch.onnx.export (first calls during its capture),
    # after it built its registry: they join it (integrations/onnx_registry.py).
    ste, split = make_functions()
    torch_opaque.wrap(ste, name="TorchOnnxSTE")
    torch_opaque.wrap(split, name="TorchOnnxSplit")
    wrapped, stock = Net(ste, split).eval(), Net(*make_functions()).eval()
    batch = torch.export.Dim("batch")
    programs = [
        torch.onnx.export(m, (torch.randn(3, 4),), dynamo=True, dynamic_shapes=({0: batch},))
        for m in (wrapped, stock)
    ]
    graph = programs[0].exported_program.graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert "opaque.TorchOnnxSTE.Tensor_float" in targets, targets  # one opaque node each
    assert "opaque.TorchOnnxSplit.Tensor_Tensor" in targets, targets
    # torch.onnx inlines every model-local function (its version converter needs an
    # inlined model): the body is there, no custom node is left
    assert not [n for n in programs[0].model.graph if n.domain == "opaque"]
    assert "Sign" in [n.op_type for n in programs[0].model.graph]
    for n in (3, 6):
        x = torch.randn(n, 4)
        got, want = run_ort(programs[0], x), run_ort(programs[1], x)
        eager = wrapped(x)
        for g, w, e in zip(got, want, eager):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(g, e.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_exported_programs_and_cpp_ops_and_a_callers_own_translation(example_ops):
    ste, split = make_functions()
    torch_opaque.wrap(ste, name="TorchOnnxSTE2")

    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.ops.example.scaled_sin(ste.apply(x, 2.0), 1.5)
            return y * 2, SvdTop.apply(x[:, :3] @ x[:, :3].T)

    x = torch.randn(3, 4)
    ep = torch.export.export(M(), (x,), strict=False)  # the ops exist before the export
    # SvdTop's forward (an SVD) has no ONNX translation: the caller's table entry
    # for it wins over torch_opaque's translation
    svd_target = next(n.target for n in ep.graph.nodes if "OnnxSvdTop" in str(n.target))
    program = torch.onnx.export(
        ep, dynamo=True, custom_translation_table={svd_target: lambda a: op.Neg(a)}
    )
    y, top = run_ort(program, x)
    want_y, _ = M()(x)
    np.testing.assert_allclose(y, want_y.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top, -(x[:, :3] @ x[:, :3].T).numpy(), rtol=1e-5, atol=1e-6)


def test_an_untranslatable_forward_names_the_function_and_the_ways_out():
    class M(torch.nn.Module):
        def forward(self, x):
            return SvdTop.apply(x)

    with pytest.raises(Exception) as info:
        torch.onnx.export(M().eval(), (torch.randn(3, 3),), dynamo=True)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    ours = [m for m in chain if m.startswith("torch_opaque.onnx: the forward of opaque::OnnxSvdTop")]
    assert ours, chain
    assert "aten._linalg_svd" in ours[0] and "mapping=" in ours[0], ours[0]


def test_torch_opaque_onnx_export_builds_torchs_registry_once():
    # Each function body is exported by torch.onnx, which builds its registry
    # afresh each time (~4 s) unless torch_opaque.onnx reuses one (Note [Registry reuse]).
    ste, split = make_functions()
    torch_opaque.wrap(ste, name="TorchOnnxSTE3")
    torch_opaque.wrap(split, name="TorchOnnxSplit3")
    onnx_registry._REGISTRIES.clear()
    before = onnx_registry.BUILDS[0]
    proto = torch_opaque.onnx.export(Net(ste, split), (torch.randn(3, 4),))
    assert sorted(f.name for f in proto.functions) == ["TorchOnnxSTE3", "TorchOnnxSplit3"]
    assert onnx_registry.BUILDS[0] - before == 1
