"""torch_opaque.passes: each pass returns a valid program that runs and matches."""

import pytest
import torch

import torch_opaque
from torch_opaque import passes
from torch_opaque.ops import opaque_nodes
from opaque_fixtures import archops

ALL = ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]


@pytest.fixture(scope="module")
def ep():
    return archops.export_net()


def x_of(batch):
    return archops.example_input(batch)


def names(program):
    return sorted({r.qualified_name for r in passes.list_opaque_ops(program)})


def assert_matches(program, reference, batches=(5, 9)):
    for b in batches:
        x = x_of(b)
        torch.testing.assert_close(program.module()(x), reference.module()(x))


def training_form_program():
    """A program holding Name_fwd calls: dynamo's ATen graph of a call on inputs
    that require grad, exported again."""
    x = x_of(5)
    gm, _ = torch._dynamo.export(archops.Net(), aten_graph=True)(x.clone().requires_grad_())
    gm.graph.eliminate_dead_code()  # the unused getitems on the residual lists
    gm.recompile()
    return torch.export.export(gm, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))


def test_list_opaque_ops(ep):
    records = passes.list_opaque_ops(ep)
    assert [(r.qualified_name, r.overload, r.role, r.count) for r in records] == [
        ("opaque::ArchCube", "Tensor", "op", 1),
        ("opaque::ArchMulAdd", "Tensor_Tensor", "op", 1),
        ("opaque::ArchScaledSin", "Tensor_float", "op", 1),
    ]
    sin = records[2]
    assert sin.target == "opaque::ArchScaledSin.Tensor_float"
    assert sin.schema == "opaque::ArchScaledSin.Tensor_float(Tensor x, float scale) -> Tensor"
    assert sin.defined_by == "opaque_fixtures.archops.ScaledSin"


def test_inline_all_leaves_no_opaque_node_and_matches(ep):
    out = passes.inline(ep)
    assert passes.list_opaque_ops(out) == []
    assert not opaque_nodes(out.graph_module)
    assert names(ep) == ALL  # the input program is unchanged
    assert_matches(out, ep)
    # still a valid program: it serializes, decomposes and differentiates
    out.run_decompositions()
    x = x_of(4).requires_grad_()
    out.module()(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "choice",
    [
        lambda: archops.Cube,
        lambda: "opaque::ArchCube",
        lambda: "opaque::ArchCube.Tensor",
        lambda: torch.ops.opaque.ArchCube,
        lambda: torch.ops.opaque.ArchCube.Tensor,
        lambda: [torch_opaque.lookup(archops.Cube)],
    ],
    ids=["class", "name", "overload-name", "packet", "overload", "opaque-function"],
)
def test_inline_chosen_ops(ep, choice):
    out = passes.inline(ep, ops=choice())  # (the ops exist once `ep` is exported)
    assert names(out) == ["opaque::ArchMulAdd", "opaque::ArchScaledSin"]
    assert_matches(out, ep)


def test_inline_nested_ops():
    ep = archops.export_nested()
    only_outer = passes.inline(ep, ops=[archops.Outer])
    assert names(only_outer) == ["opaque::ArchCube"]  # Outer's forward calls Cube
    everything = passes.inline(ep)
    assert names(everything) == []
    assert_matches(only_outer, ep)
    assert_matches(everything, ep)


def test_inline_unknown_op_is_an_error(ep):
    with pytest.raises(ValueError, match="does not call opaque::Nope"):
        passes.inline(ep, ops="opaque::Nope")
    with pytest.raises(ValueError, match="not an opaque op"):
        passes.inline(ep, ops=torch.ops.aten.sin.default)


def test_replace_with_python_function(ep):
    out = passes.replace(ep, archops.ScaledSin, lambda x, scale: torch.sin(x) * scale)
    assert names(out) == ["opaque::ArchCube", "opaque::ArchMulAdd"]
    assert_matches(out, ep)


def test_replace_with_another_opaque_op(ep):
    out = passes.replace(ep, "opaque::ArchCube", archops.CubeAlt)
    assert names(out) == ["opaque::ArchCubeAlt", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]
    assert_matches(out, ep)


def test_replace_with_an_aten_op():
    class M(torch.nn.Module):
        def forward(self, x):
            return archops.ScaledSin.apply(x, 1.0) * 2

    ep = torch.export.export(M(), (torch.randn(4),))
    out = passes.replace(ep, archops.ScaledSin, lambda x, scale: torch.ops.aten.sin.default(x))
    assert names(out) == []
    x = torch.randn(4)
    torch.testing.assert_close(out.module()(x), x.sin() * 2)


def test_replace_checks_the_outputs(ep):
    with pytest.raises(RuntimeError, match="returns 2 tensor"):
        passes.replace(ep, archops.MulAdd, lambda a, b: a * b)


def test_strip_residuals_turns_training_form_into_ops(ep):
    train = training_form_program()
    assert {r.role for r in passes.list_opaque_ops(train)} == {"fwd"}
    out = passes.strip_residuals(train)
    records = passes.list_opaque_ops(out)
    assert {r.role for r in records} == {"op"}
    assert [r.target for r in records] == [
        "opaque::ArchCube.Tensor",
        "opaque::ArchMulAdd.Tensor_Tensor",
        "opaque::ArchScaledSin.Tensor_float",
    ]
    assert {r.role for r in passes.list_opaque_ops(train)} == {"fwd"}  # unchanged
    assert_matches(out, ep)
    assert_matches(out, train)
    # the result is a valid program: it decomposes and trains with the custom backward
    out.run_decompositions()
    x = x_of(6).requires_grad_()
    out.module()(x).sum().backward()
    xr = x.detach().clone().requires_grad_()
    archops.Net()(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_inline_and_replace_on_training_form(ep):
    train = training_form_program()
    inlined = passes.inline(train)
    assert names(inlined) == []
    assert_matches(inlined, ep)
    replaced = passes.replace(train, archops.Cube, lambda x: x**3)
    assert names(replaced) == ["opaque::ArchMulAdd", "opaque::ArchScaledSin"]
    assert_matches(replaced, ep)


def test_passes_need_an_exported_program():
    with pytest.raises(TypeError, match="ExportedProgram"):
        passes.inline(archops.Net())


def test_strip_and_replace_when_the_opaque_output_is_the_program_output():
    """A training-form call whose output the program returns directly: the
    rewritten node replaces the returned one, and the signature follows it."""
    x = torch.randn(4)
    gm, _ = torch._dynamo.export(lambda t: archops.Cube.apply(t), aten_graph=True)(
        x.clone().requires_grad_()
    )
    program = torch.export.export(gm, (x,))
    stripped = passes.strip_residuals(program)
    assert [r.role for r in passes.list_opaque_ops(stripped)] == ["op"]
    torch.testing.assert_close(stripped.module()(x), x**3)
    replaced = passes.replace(program, archops.Cube, lambda t: t * t * t + 1)
    assert passes.list_opaque_ops(replaced) == []
    torch.testing.assert_close(replaced.module()(x), x**3 + 1)


@pytest.mark.parametrize(
    "view", [lambda x, scale: x.view(x.shape), lambda x, scale: x[:], lambda x, scale: x.t().t()]
)
def test_replace_with_a_function_returning_a_view_of_its_input(view):
    """The replacement returns a view of its argument (not the argument itself):
    the rewritten program's output is a copy, as an op's output may not alias
    its input, so changing the output in place leaves the input alone (as with
    the original program)."""

    class M(torch.nn.Module):
        def forward(self, x):
            return archops.ScaledSin.apply(x, 2.0)

    ep = torch.export.export(M(), (torch.randn(4, 3),))
    out = passes.replace(ep, archops.ScaledSin, view)
    assert names(out) == []
    x = torch.randn(4, 3)
    before = x.clone()
    y = out.module()(x)
    torch.testing.assert_close(y, before)
    y.add_(1)
    torch.testing.assert_close(x, before)
