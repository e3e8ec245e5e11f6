"""ONNX export of ops defined in C++ (examples/cpp): custom-domain nodes whose
model-local functions are the ops' own kernels traced to ATen, so onnxruntime
computes what eager PyTorch computes, in inference and training programs."""

import numpy as np
import onnxruntime
import pytest
import torch

import torch_opaque
import torch_opaque.onnx
from torch_opaque.onnx import OnnxExportError

pytestmark = pytest.mark.usefixtures("example_ops")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 5)

    def forward(self, x):
        y = torch.ops.example.scaled_sin(self.lin(x), 1.5)
        values, indices = torch.ops.example.top_value(y, 1)
        return values, indices


def run_ort(proto, *args):
    sess = onnxruntime.InferenceSession(proto.SerializeToString())
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: a.numpy() for n, a in zip(names, args)})


def custom(proto):
    return sorted(n.op_type for n in proto.graph.node if n.domain == "example")


def test_cpp_ops_get_function_bodies_onnxruntime_runs():
    net = Net()
    proto = torch_opaque.onnx.export(net, (torch.randn(3, 4),),
                                     dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert custom(proto) == ["scaled_sin", "top_value"]
    bodies = {f.name: [n.op_type for n in f.node] for f in proto.functions}
    assert "Sin" in bodies["scaled_sin"] and "ArgMax" in bodies["top_value"], bodies
    for n in (3, 8):
        x = torch.randn(n, 4)
        values, indices = run_ort(proto, x)
        want_values, want_indices = net(x)
        np.testing.assert_allclose(values, want_values.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(indices, want_indices.numpy())


class Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x, target):
        values, _ = self.net(x)
        return torch.nn.functional.mse_loss(values, target)


def test_training_programs_with_cpp_ops_give_eager_loss_and_gradients():
    model = Loss()
    x, t = torch.randn(6, 4), torch.randn(6)
    step = torch_opaque.export_training(model, (x, t))
    proto = torch_opaque.onnx.export(step)
    assert custom(proto) == sorted(f"{n}_{r}" for n in ("scaled_sin", "top_value")
                                   for r in ("fwd", "bwd"))
    bodies = {f.name: [n.op_type for n in f.node] for f in proto.functions}
    assert "Cos" in bodies["scaled_sin_bwd"]  # the C++ backward, traced
    assert "ScatterElements" in bodies["top_value_bwd"], bodies["top_value_bwd"]
    model.zero_grad()
    loss = model(x, t)
    loss.backward()
    want = [loss.detach()] + [p.grad for p in model.parameters()]
    got = run_ort(proto, x, t)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)


class Looped(torch.nn.Module):
    def forward(self, x):
        return torch.ops.example.square_loop(torch.ops.example.scaled_sin(x, 2.0))


def test_a_kernel_that_is_not_made_of_aten_ops_names_the_op_and_the_ways_out():
    x = torch.randn(3, 4)
    with pytest.raises(OnnxExportError) as err:
        torch_opaque.onnx.export(Looped(), (x,))
    msg = str(err.value)
    assert msg.startswith("torch_opaque.onnx: the forward of example::square_loop (defined in "
                          "C++) cannot be traced to ATen ops for its ONNX function"), msg
    assert "data_ptr" in msg and "functions=False" in msg
    assert "mapping={'example::square_loop'" in msg
    proto = torch_opaque.onnx.export(Looped(), (x,), functions=False)
    assert custom(proto) == ["scaled_sin", "square_loop"]
    assert list(proto.functions) == []


class ListOps(torch.nn.Module):
    def forward(self, a, b, w):
        return torch.ops.example.weighted_sum([a, b], w)


def test_a_tensor_list_argument_gets_its_function_body():
    args = (torch.randn(3), torch.randn(3), torch.tensor([0.5, 2.0]))
    proto = torch_opaque.onnx.export(ListOps(), args)
    assert custom(proto) == ["weighted_sum"]
    (got,) = run_ort(proto, *args)
    np.testing.assert_allclose(got, ListOps()(*args).numpy(), rtol=1e-6)


def test_a_tensor_list_result_is_refused_by_name():
    class Means(torch.nn.Module):
        def forward(self, x):
            m1, m2 = torch.ops.example.power_means(x, [1, 2])
            return m1 + m2

    with pytest.raises(OnnxExportError, match=r"example::power_means returns Tensor\[\].*"
                       r"functions=False"):
        torch_opaque.onnx.export(Means(), (torch.rand(4, 3),))
