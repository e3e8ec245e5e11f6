"""A C++ op with a data-dependent output size (examples/cpp/dynamic_size_ops.cpp:
example::threshold_select, whose fake calls ctx.new_dynamic_size()), and debug
mode (torch_opaque.set_debug)."""

import pytest
import torch

import torch_opaque
from conftest import op_calls

pytestmark = pytest.mark.usefixtures("example_ops")


def select_ref(x, t):
    return x.masked_select(x > t)


def test_eager_values_and_gradients():
    x = torch.randn(4, 5, dtype=torch.double, requires_grad=True)
    out = torch.ops.example.threshold_select(x, 0.1)
    torch.testing.assert_close(out, select_ref(x.detach(), 0.1))
    assert torch.autograd.gradcheck(lambda t: torch.ops.example.threshold_select(t, 0.1), (x,))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.example.threshold_select(self.lin(x), 0.0).square().sum()


def test_export_dynamic_batch_and_data_dependent_size():
    torch.manual_seed(0)
    model = Model()
    ep = torch.export.export(
        model, (torch.randn(6, 4),), dynamic_shapes=({0: torch.export.Dim("b")},)
    )
    assert len(op_calls(ep.graph_module, "threshold_select", "example")) == 1
    node = op_calls(ep.graph_module, "threshold_select", "example")[0]
    size = node.meta["val"].shape[0]
    assert isinstance(size, torch.SymInt) and str(size).startswith("u")  # unbacked
    mod = ep.module()
    for n in (3, 9):
        x = torch.randn(n, 4)
        torch.testing.assert_close(mod(x), model(x))
    x = torch.randn(9, 4)
    mod(x).backward()
    model(x).backward()
    for (name, p), q in zip(mod.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_compile_with_dynamic_output_shapes(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for n in (3, 5):
        x = torch.randn(n, 4)
        out, ref = compiled(x), model(x)
        torch.testing.assert_close(out, ref)
        model.zero_grad()
        out.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref.backward()
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad)


def test_debug_mode_switch():
    assert not torch_opaque.debug_enabled()
    torch_opaque.set_debug(True)
    try:
        assert torch_opaque.debug_enabled()
        # a fake with a dynamic size is not compared: no false alarm
        x = torch.tensor([1.0, -1.0, 2.0])
        torch.testing.assert_close(torch.ops.example.threshold_select(x, 0.0), x[x > 0])
    finally:
        torch_opaque.set_debug(False)
