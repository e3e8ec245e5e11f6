"""C++ ops' kernels serve as fakes with symbolic sizes (Note [C++ kernels as
fakes], torch_opaque/_impl/cpp_fakes.py): a kernel that broadcasts along a
dynamic dimension traces under FakeTensorMode, torch.export with a dynamic
batch and export_training, and the results equal eager autograd."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import torch_opaque
from torch_opaque._impl.cpp_fakes import has_kernel_fake

pytestmark = pytest.mark.usefixtures("example_ops")


def symbolic_batch(mode, t):
    dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1)
    return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def test_load_library_registers_kernel_fakes():
    for name in ("example::power_means", "example::power_means_fwd", "example::power_means_bwd",
                 "example::weighted_sum_bwd", "example::top_value_bwd"):
        assert has_kernel_fake(name), name
    assert not has_kernel_fake("aten::add")


def test_kernel_broadcasts_on_a_symbolic_batch():
    # weighted_sum's kernel broadcasts xs[i] * w[i] (a 0-d weight) over the
    # batch: with a symbolic batch this failed with "SymIntArrayRef expected to
    # contain only concrete integers" when the kernel ran as a plain Meta kernel.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    xs = [symbolic_batch(mode, torch.randn(5, 4)) for _ in range(2)]
    w = mode.from_tensor(torch.randn(2))
    with mode:
        out = torch.ops.example.weighted_sum(xs, w)
        outs, _ = torch.ops.example.weighted_sum_fwd(xs, w, [True, True])
    assert out.shape == xs[0].shape and isinstance(out.shape[0], torch.SymInt)
    assert outs.shape == xs[0].shape


class PowerMeansLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        means = torch.ops.example.power_means(x * self.weight, [1, 2, 3])
        return sum(m.sum() for m in means)


def test_export_training_with_a_dynamic_batch_equals_eager():
    torch.manual_seed(0)
    model = PowerMeansLoss()
    batch = torch.export.Dim("batch")
    step = torch_opaque.export_training(model, (torch.randn(5, 4),),
                                        dynamic_shapes=({0: batch},))
    targets = {str(n.target) for n in step.graph.nodes if n.op == "call_function"}
    assert {"example.power_means_fwd.default", "example.power_means_bwd.default"} <= targets
    for n in (3, 8):  # other batch sizes than the traced one
        x = torch.randn(n, 4)
        loss, grad_w = step.module()(x)
        model.zero_grad()
        ref = model(x)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(grad_w, model.weight.grad)


def test_inference_export_with_a_dynamic_batch_decomposes():
    model = PowerMeansLoss()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (torch.randn(5, 4),), dynamic_shapes=({0: batch},))
    ep = ep.run_decompositions()
    x = torch.randn(7, 4)
    torch.testing.assert_close(ep.module()(x), model(x))
