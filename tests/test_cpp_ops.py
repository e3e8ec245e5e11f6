"""Ops written in C++ with torch_opaque/op.h (examples/cpp), used from Python.

scripts/dev.sh builds examples/cpp against the installed CMake package before
the tests run; the library registers example::scaled_sin, example::top_value and
example::scaled_arange (the tensor-list and data-dependent ops have files of
their own).
"""

import pathlib

import pytest
import torch

import torch_opaque
from conftest import aten_calls, op_calls
from support.build_tree import TEST_LIBS, missing

ROOT = pathlib.Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("example_ops")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.ops.example.scaled_sin(self.lin(x), 2.0)
        values, idx = torch.ops.example.top_value(y, 1)
        return values, idx


def test_schemas_and_eager_gradients():
    assert str(torch.ops.example.scaled_sin.default._schema) == (
        "example::scaled_sin(Tensor x, float scale) -> Tensor"
    )
    assert str(torch.ops.example.top_value.default._schema) == (
        "example::top_value(Tensor x, int dim=-1) -> (Tensor values, Tensor indices)"
    )
    assert str(torch.ops.example.top_value_fwd.default._schema).endswith(
        "-> (Tensor values, Tensor indices, Tensor[] residuals)"
    )
    x = torch.randn(3, 5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.example.scaled_sin(t, 1.5), (x,))
    assert torch.autograd.gradcheck(lambda t: torch.ops.example.top_value(t, 1)[0], (x,))
    values, idx = torch.ops.example.top_value(x, 0)
    assert values.requires_grad and not idx.requires_grad
    values, idx = torch.ops.example.top_value(x)  # dim=-1 by default
    torch.testing.assert_close(values, x.detach().max(-1).values)


def test_backward_written_with_aten_ops_is_differentiable():
    """Double backward through C++ backwards: they are written with ATen ops,
    which record their derivatives under create_graph=True."""
    x = torch.randn(3, 5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: torch.ops.example.scaled_sin(t, 1.5), (x,))
    assert torch.autograd.gradgradcheck(lambda t: torch.ops.example.top_value(t, 1)[0], (x,))
    (g,) = torch.autograd.grad(torch.ops.example.scaled_sin(x, 2.0).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(h, -2.0 * x.detach().sin())


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_one_node_each_and_trains(strict):
    torch.manual_seed(0)
    model = Model()
    ep = torch.export.export(
        model, (torch.randn(6, 4),), dynamic_shapes=({0: torch.export.Dim("b")},), strict=strict
    )
    for prog in (ep, ep.run_decompositions()):
        gm = prog.graph_module
        assert len(op_calls(gm, "scaled_sin", "example")) == 1
        assert len(op_calls(gm, "top_value", "example")) == 1
        assert not aten_calls(gm, "sin") and not aten_calls(gm, "max")
    x = torch.randn(9, 4)
    mod = ep.module()
    mod(x)[0].sum().backward()
    model(x)[0].sum().backward()
    for (name, p), q in zip(mod.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize(
    "name,args",
    [
        ("scaled_sin", (torch.randn(3, 4, requires_grad=True), 0.5)),
        ("scaled_sin", (torch.randn(2), 3.0)),
        ("top_value", (torch.randn(3, 4, requires_grad=True), 1)),
    ],
)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.example, name).default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    def f(x):
        v, _ = torch.ops.example.top_value(torch.ops.example.scaled_sin(x, 2.0), 1)
        return v.exp()

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, ref = compiled(x), f(x2)
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)


def test_failed_registrations_raise_a_catchable_error():
    """A library whose TORCH_OPAQUE_DEF lines fail at load time: a Python
    exception that names each failure, not a process ended by std::terminate;
    the op that did register works."""
    bad = TEST_LIBS / "libbad_registration_ops.so"
    assert bad.exists(), missing(bad)
    with pytest.raises(torch_opaque.RegistrationError) as info:
        torch_opaque.load_library(bad)
    msg = str(info.value)
    assert "failed to register 2 op(s)" in msg
    assert "the name must be qualified, as in \"myops::my_op\"" in msg
    assert "opaque_bad_registration::twice is already defined" in msg
    x = torch.randn(3, requires_grad=True)
    torch.ops.opaque_bad_registration.twice(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_the_benchmark_baseline_is_a_correct_op():
    """The C++ benchmark's hand-written op (benchmarks/cpp/handwritten_scaled_sin.cpp,
    without Meta kernels) passes what the torch_opaque op passes: opcheck,
    export with one node, compile with its backward op."""
    lib = TEST_LIBS / "libhandwritten_ops.so"
    assert lib.exists(), missing(lib)
    torch.ops.load_library(str(lib))
    op = torch.ops.handwritten.scaled_sin.default
    torch.library.opcheck(op, (torch.randn(3, 4, requires_grad=True), 0.5))

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.handwritten.scaled_sin(x, 2.0)

    ep = torch.export.export(M(), (torch.randn(4, 3),), dynamic_shapes=({0: torch.export.Dim("b")},))
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"] == [op]
    compiled = torch.compile(M(), backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 3, requires_grad=True)
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


class ArangeModel(torch.nn.Module):
    def forward(self, x):
        return x * torch.ops.example.scaled_arange(x.shape[0], 2.0, dtype=torch.float64)


@pytest.mark.parametrize("strict", [False, True])
def test_factory_op_exports_with_a_dynamic_size(strict):
    """A C++ op without tensor arguments (dtype and device are arguments)."""
    assert str(torch.ops.example.scaled_arange.default._schema) == (
        "example::scaled_arange(SymInt n, float scale=1., ScalarType? dtype=None, "
        "Device? device=None) -> Tensor"
    )
    torch.testing.assert_close(torch.ops.example.scaled_arange(4), torch.arange(4.0))
    ep = torch.export.export(
        ArangeModel(), (torch.randn(4, dtype=torch.float64),),
        dynamic_shapes=({0: torch.export.Dim("n")},), strict=strict,
    )
    assert len(op_calls(ep.graph_module, "scaled_arange", "example")) == 1
    x = torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(ep.module()(x), x * torch.arange(7.0, dtype=torch.float64) * 2)
    compiled = torch.compile(ArangeModel(), backend="inductor", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), x * torch.arange(7.0, dtype=torch.float64) * 2)
