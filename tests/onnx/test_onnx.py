"""ONNX export (torch_opaque.onnx): one custom node per opaque op call, with
model-local functions so onnxruntime runs the model as exported."""

import doctest

import pytest
import torch

import onnx
import onnxruntime
import onnxscript

from onnxscript import FLOAT  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

import torch_opaque  # noqa: E402
import torch_opaque.onnx  # noqa: E402
from torch_opaque.onnx import OnnxExportError  # noqa: E402


# ---- ops ---------------------------------------------------------------------------


@torch_opaque.op(name="OnnxSeedFoo")
class Foo(torch.autograd.Function):  # the seed example
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


@torch_opaque.op(name="OnnxTwo")
class Two(torch.autograd.Function):  # two outputs
    @staticmethod
    def forward(ctx, x, y):
        return x * y, x - y

    @staticmethod
    def backward(ctx, ga, gb):
        return ga + gb, ga - gb


@torch_opaque.op(name="OnnxScaled")
class Scaled(torch.autograd.Function):  # non-tensor float / int arguments
    @staticmethod
    def forward(ctx, x, scale: float, shift: int):
        y = torch.tanh(x) * scale + shift
        ctx.save_for_backward(y)
        ctx.scale, ctx.shift = scale, shift
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        t = (y - ctx.shift) / ctx.scale
        return g * ctx.scale * (1 - t * t), None, None


@torch_opaque.op(name="OnnxMix")
class Mix(torch.autograd.Function):  # a Tensor list, an optional Tensor, a list of floats
    @staticmethod
    def forward(ctx, xs, bias, weights):
        out = sum(w * x for w, x in zip(weights, xs))
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, g):
        return None, None, None


@torch_opaque.op(name="OnnxModes")
class Modes(torch.autograd.Function):  # str, bool and dtype arguments
    @staticmethod
    def forward(ctx, x, mode, negate, dtype):
        y = x * 2 if mode == "double" else x + 1
        return (-y if negate else y).to(dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


@torch_opaque.op(name="OnnxOuter")
class Outer(torch.autograd.Function):  # its forward calls another opaque op
    @staticmethod
    def forward(ctx, x):
        return Foo.apply(x) * 3

    @staticmethod
    def backward(ctx, g):
        return g


@torch_opaque.op(name="OnnxNumpy")
class NumpyCube(torch.autograd.Function):  # runs, traces with `fake`, but not to ATen
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy() ** 3)

    @staticmethod
    def fake(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


@torch_opaque.op(name="OnnxPinned")
class Pinned(torch.autograd.Function):  # its forward only works for 4 rows
    @staticmethod
    def forward(ctx, x):
        return x + torch.ones(4, x.shape[1])

    @staticmethod
    def fake(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


# ---- onnxscript functions for mapping= (onnxscript resolves names in module globals) ----

MY_OPS = onnxscript.values.Opset("my.ops", 1)


@onnxscript.script(MY_OPS, default_opset=op)
def ScaledTanh(x: FLOAT, scale: float, shift: int) -> FLOAT:
    s = op.CastLike(op.Constant(value_float=scale), x)
    b = op.CastLike(op.Constant(value_int=shift), x)
    return op.Add(op.Mul(op.Tanh(x), s), b)


@onnxscript.script(MY_OPS, default_opset=op)
def Cube(x: FLOAT) -> FLOAT:
    return op.Mul(op.Mul(x, x), x)


@onnxscript.script(MY_OPS, default_opset=op)
def Sine(x):  # no annotations
    return op.Sin(x)


# ---- models ----------------------------------------------------------------------------


class Seed(torch.nn.Module):
    def forward(self, x):
        return Foo.apply(x)


class Several(torch.nn.Module):
    def forward(self, x, y):
        a, b = Two.apply(x, y)
        c = Scaled.apply(b, 1.5, 2)
        return Foo.apply(a) + Foo.apply(c), Scaled.apply(x, 0.5, -1)


BATCH = torch.export.Dim("batch", min=2)


def xy(n):
    return torch.randn(n, 3), torch.randn(n, 3)


def run_ort(proto, *inputs):
    onnx.checker.check_model(proto, full_check=True)
    sess = onnxruntime.InferenceSession(proto.SerializeToString())
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})


def assert_matches(proto, model, *inputs):
    expected = model(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = run_ort(proto, *inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(torch.from_numpy(g), e, rtol=1e-5, atol=1e-5)


def custom_nodes(graph_or_fn, domain="opaque"):
    return [n for n in graph_or_fn.node if n.domain == domain]


def attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def functions(proto) -> dict:
    return {(f.domain, f.name, f.overload): f for f in proto.functions}


# ---- the seed ------------------------------------------------------------------------


def test_seed_one_custom_node_with_function(tmp_path):
    path = tmp_path / "seed.onnx"
    x = torch.randn(4, 3)
    proto = torch_opaque.onnx.export(Seed(), (x,), str(path), dynamic_shapes=({0: BATCH},))
    assert isinstance(proto, onnx.ModelProto)
    (node,) = proto.graph.node
    assert (node.domain, node.op_type) == ("opaque", "OnnxSeedFoo")
    assert node.overload.startswith("Tensor_")
    assert {o.domain: o.version for o in proto.opset_import}["opaque"] == 1
    fn = functions(proto)[("opaque", "OnnxSeedFoo", node.overload)]
    assert [n.op_type for n in fn.node] == ["Sin"]
    assert list(fn.input) == ["x"] and len(fn.output) == 1
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 3
    assert onnx.load(str(path)) == proto
    for n in (4, 2, 11):  # dynamic batch
        assert_matches(proto, Seed(), torch.randn(n, 3))


def test_seed_functions_false_keeps_a_bare_node():
    proto = torch_opaque.onnx.export(Seed(), (torch.randn(3),), functions=False)
    (node,) = proto.graph.node
    assert (node.domain, node.op_type, node.overload) == ("opaque", "OnnxSeedFoo", "")
    assert not proto.functions
    onnx.checker.check_model(proto, full_check=True)


def test_seed_exported_program_input():
    ep = torch.export.export(Seed(), (torch.randn(5, 2),), dynamic_shapes=({0: BATCH},))
    proto = torch_opaque.onnx.export(ep, (), dynamic_shapes=({0: BATCH},))
    assert [n.op_type for n in proto.graph.node] == ["OnnxSeedFoo"]
    assert_matches(proto, Seed(), torch.randn(8, 2))


# ---- several ops -------------------------------------------------------------------------


def test_several_ops_nodes_attributes_and_functions():
    proto = torch_opaque.onnx.export(
        Several(), xy(4), dynamic_shapes=({0: BATCH}, {0: BATCH})
    )
    nodes = custom_nodes(proto.graph)
    assert sorted(n.op_type for n in nodes) == sorted(
        ["OnnxTwo", "OnnxScaled", "OnnxSeedFoo", "OnnxSeedFoo", "OnnxScaled"]
    )
    (two,) = [n for n in nodes if n.op_type == "OnnxTwo"]
    assert len(two.input) == 2 and len(two.output) == 2 and not two.attribute
    scaled = [n for n in nodes if n.op_type == "OnnxScaled"]
    assert sorted(attrs(n)["scale"] for n in scaled) == [0.5, 1.5]
    assert sorted(attrs(n)["shift"] for n in scaled) == [-1, 2]
    types = {a.name: a.type for a in scaled[0].attribute}
    assert types == {"scale": onnx.AttributeProto.FLOAT, "shift": onnx.AttributeProto.INT}
    # Foo is called twice with the same input kind: one function for both calls;
    # Scaled twice with different attributes: one function each
    foo_overloads = {n.overload for n in nodes if n.op_type == "OnnxSeedFoo"}
    assert len(foo_overloads) == 1
    assert len({n.overload for n in scaled}) == 2
    fns = functions(proto)
    assert len(fns) == 4
    for n in nodes:
        fn = fns[("opaque", n.op_type, n.overload)]
        assert len(fn.output) == len(n.output)
        assert not custom_nodes(fn)  # bodies are standard ONNX ops
    two_fn = fns[("opaque", "OnnxTwo", two.overload)]
    assert sorted(n.op_type for n in two_fn.node) == ["Mul", "Sub"]
    scaled_fn = fns[("opaque", "OnnxScaled", scaled[0].overload)]
    assert "Tanh" in [n.op_type for n in scaled_fn.node]
    assert {a.name for a in scaled_fn.attribute_proto} == {"scale", "shift"}


def test_several_ops_onnxruntime_matches_pytorch_dynamic_batch():
    proto = torch_opaque.onnx.export(
        Several(), xy(4), dynamic_shapes=({0: BATCH}, {0: BATCH})
    )
    for n in (4, 3, 17):
        assert_matches(proto, Several(), *xy(n))


def test_static_shapes_and_opset():
    proto = torch_opaque.onnx.export(Several(), xy(4), opset=20)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 20
    assert_matches(proto, Several(), *xy(4))


def test_tensor_list_optional_tensor_and_float_list():
    class M(torch.nn.Module):
        def forward(self, a, b, c):
            return Mix.apply([a, b], None, [0.5, 2.0]) + Mix.apply([a, b, c], c, [1.0, 1.0, 3.0])

    inputs = (torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5))
    proto = torch_opaque.onnx.export(M(), inputs)
    first, second = custom_nodes(proto.graph)
    assert attrs(first)["weights"] == [0.5, 2.0]
    assert len(first.input) == 2  # xs_0, xs_1; the trailing None input is left out
    assert len(second.input) == 4  # xs_0..xs_2, bias
    fn = functions(proto)[("opaque", "OnnxMix", second.overload)]
    assert list(fn.input) == ["xs_0", "xs_1", "xs_2", "bias"]
    assert_matches(proto, M(), *inputs)


def test_string_bool_and_dtype_attributes():
    class M(torch.nn.Module):
        def forward(self, x):
            return Modes.apply(x, "double", True, torch.float64), Modes.apply(x, "inc", False,
                                                                                 torch.float32)

    proto = torch_opaque.onnx.export(M(), (torch.randn(3, 2),), dynamic_shapes=({0: BATCH},))
    first, second = custom_nodes(proto.graph)
    assert attrs(first) == {"mode": b"double", "negate": 1, "dtype": onnx.TensorProto.DOUBLE}
    assert attrs(second) == {"mode": b"inc", "negate": 0, "dtype": onnx.TensorProto.FLOAT}
    assert first.overload != second.overload
    assert_matches(proto, M(), torch.randn(5, 2))


def test_opaque_op_inside_a_forward():
    class M(torch.nn.Module):
        def forward(self, x):
            return Outer.apply(x) + 1

    proto = torch_opaque.onnx.export(M(), (torch.randn(4, 2),), dynamic_shapes=({0: BATCH},))
    (outer,) = custom_nodes(proto.graph)
    assert outer.op_type == "OnnxOuter"
    # the inner op's function is inlined into the outer body (onnxruntime does not
    # resolve overloaded calls made inside functions)
    (body,) = proto.functions
    assert (body.name, body.overload) == ("OnnxOuter", outer.overload)
    assert sorted(n.op_type for n in body.node) == ["Constant", "Mul", "Sin"]
    assert_matches(proto, M(), torch.randn(6, 2))

    proto = torch_opaque.onnx.export(M(), (torch.randn(4, 2),), functions=False)
    assert [n.op_type for n in custom_nodes(proto.graph)] == ["OnnxOuter"]


# ---- mapping and inlining ----------------------------------------------------------------


def test_mapping_to_a_standard_op_removes_the_custom_node():
    proto = torch_opaque.onnx.export(
        Seed(), (torch.randn(4, 3),), dynamic_shapes=({0: BATCH},),
        mapping={"opaque::OnnxSeedFoo": "Sin"},
    )
    assert [(n.domain, n.op_type) for n in proto.graph.node] == [("", "Sin")]
    assert not proto.functions
    assert "opaque" not in {o.domain for o in proto.opset_import}
    assert_matches(proto, Seed(), torch.randn(9, 3))


def test_mapping_relu_by_class_key():
    proto = torch_opaque.onnx.export(Seed(), (torch.randn(3),), mapping={Foo: "Relu"})
    assert [n.op_type for n in proto.graph.node] == ["Relu"]
    onnx.checker.check_model(proto, full_check=True)


def test_mapping_to_an_onnxscript_function():
    proto = torch_opaque.onnx.export(
        Several(), xy(4), dynamic_shapes=({0: BATCH}, {0: BATCH}),
        mapping={"opaque::OnnxScaled": ScaledTanh},
    )
    assert not [n for n in custom_nodes(proto.graph) if n.op_type == "OnnxScaled"]
    mine = custom_nodes(proto.graph, "my.ops")
    assert [n.op_type for n in mine] == ["ScaledTanh", "ScaledTanh"]
    assert sorted(attrs(n)["scale"] for n in mine) == [0.5, 1.5]
    assert sorted(attrs(n)["shift"] for n in mine) == [-1, 2]
    assert {o.domain: o.version for o in proto.opset_import}["my.ops"] == 1
    assert ("my.ops", "ScaledTanh", "") in functions(proto)
    assert_matches(proto, Several(), *xy(6))

    inlined = torch_opaque.onnx.export(
        Several(), xy(4), mapping={"opaque::OnnxScaled": ScaledTanh}, inline=True
    )
    assert not custom_nodes(inlined.graph, "my.ops") and not custom_nodes(inlined.graph)
    assert_matches(inlined, Several(), *xy(4))


def test_mapping_to_an_onnxscript_function_without_annotations():
    proto = torch_opaque.onnx.export(Seed(), (torch.randn(3),), mapping={Foo: Sine})
    assert [(n.domain, n.op_type) for n in proto.graph.node] == [("my.ops", "Sine")]
    assert_matches(proto, Seed(), torch.randn(3))


def test_mapping_to_an_onnxscript_function_lacking_an_attribute():
    with pytest.raises(OnnxExportError, match="argument 'scale', which ONNX Cube has no attr"):
        torch_opaque.onnx.export(Several(), xy(2), mapping={"opaque::OnnxScaled": Cube})


def test_inline_leaves_no_custom_node():
    proto = torch_opaque.onnx.export(
        Several(), xy(4), dynamic_shapes=({0: BATCH}, {0: BATCH}), inline=True
    )
    assert all(n.domain == "" for n in proto.graph.node)
    assert not proto.functions
    assert {o.domain for o in proto.opset_import} == {""}
    assert_matches(proto, Several(), *xy(5))


def test_inline_nested():
    class M(torch.nn.Module):
        def forward(self, x):
            return Outer.apply(x)

    proto = torch_opaque.onnx.export(M(), (torch.randn(3),), inline=True)
    assert [n.op_type for n in proto.graph.node if n.domain == ""]
    assert not custom_nodes(proto.graph) and not proto.functions
    assert_matches(proto, M(), torch.randn(3))


# ---- errors ------------------------------------------------------------------------------


class NumpyModel(torch.nn.Module):
    def forward(self, x):
        return NumpyCube.apply(x) + 1


def test_forward_not_traceable_to_aten_names_op_and_fixes():
    with pytest.raises(OnnxExportError) as info:
        torch_opaque.onnx.export(NumpyModel(), (torch.randn(3),))
    msg = str(info.value)
    assert "opaque::OnnxNumpy" in msg and "NumpyCube" in msg
    assert "cannot be traced to ATen" in msg
    assert "mapping={'opaque::OnnxNumpy'" in msg and "functions=False" in msg


def test_untraceable_forward_with_functions_false_or_mapping():
    proto = torch_opaque.onnx.export(NumpyModel(), (torch.randn(3),), functions=False)
    assert [n.op_type for n in custom_nodes(proto.graph)] == ["OnnxNumpy"]
    onnx.checker.check_model(proto, full_check=True)

    proto = torch_opaque.onnx.export(
        NumpyModel(), (torch.randn(3),), mapping={"opaque::OnnxNumpy": Cube}, inline=True
    )
    assert not custom_nodes(proto.graph)
    assert_matches(proto, NumpyModel(), torch.randn(3))


@torch_opaque.op(name="OnnxSvdTop")
class SvdTop(torch.autograd.Function):  # traceable to ATen, but no ONNX translation of svd
    @staticmethod
    def forward(ctx, x):
        u, s, vh = torch.linalg.svd(x)
        ctx.save_for_backward(u, vh)
        return s[..., :1] * 1.0

    @staticmethod
    def backward(ctx, g):
        u, vh = ctx.saved_tensors
        return g[..., None] * (u[..., :, :1] @ vh[..., :1, :])


class SvdModel(torch.nn.Module):
    def forward(self, x):
        return SvdTop.apply(x) + 1


def test_forward_without_onnx_translation_names_the_function_and_the_way_out():
    with pytest.raises(OnnxExportError) as info:
        torch_opaque.onnx.export(SvdModel(), (torch.randn(3, 3),))
    msg = str(info.value)
    assert msg.startswith(
        "torch_opaque.onnx: the forward of opaque::OnnxSvdTop (SvdTop) has no ONNX translation "
    ), msg
    assert "aten._linalg_svd" in msg
    assert "mapping={'opaque::OnnxSvdTop'" in msg and "functions=False" in msg
    proto = torch_opaque.onnx.export(SvdModel(), (torch.randn(3, 3),), functions=False)
    assert [n.op_type for n in custom_nodes(proto.graph)] == ["OnnxSvdTop"]


def test_mapping_unknown_op_lists_the_ops_found():
    with pytest.raises(OnnxExportError) as info:
        torch_opaque.onnx.export(Several(), xy(2), mapping={"opaque::Nope": "Relu"})
    msg = str(info.value)
    assert "opaque::Nope" in msg and "no such opaque op" in msg
    assert "Opaque ops found: opaque::OnnxScaled, opaque::OnnxSeedFoo, opaque::OnnxTwo" in msg


def test_mapping_to_unknown_onnx_op_or_attribute():
    with pytest.raises(OnnxExportError, match="'NotAnOnnxOp' is not a standard ONNX op"):
        torch_opaque.onnx.export(Seed(), (torch.randn(3),), mapping={Foo: "NotAnOnnxOp"})
    with pytest.raises(OnnxExportError, match="argument 'scale', which ONNX Tanh has no attr"):
        torch_opaque.onnx.export(Several(), xy(2), mapping={"opaque::OnnxScaled": "Tanh"})


def test_forward_specialising_a_dynamic_size_is_refused():
    class M(torch.nn.Module):
        def forward(self, x):
            return Pinned.apply(x)

    with pytest.raises(OnnxExportError, match="forward of opaque::OnnxPinned specialises "
                       "dimension 0 of tensor input 0, which is dynamic"):
        torch_opaque.onnx.export(M(), (torch.randn(4, 3),), dynamic_shapes=({0: BATCH},))
    proto = torch_opaque.onnx.export(M(), (torch.randn(4, 3),))  # static: fine
    assert_matches(proto, M(), torch.randn(4, 3))


def test_symbolic_non_tensor_argument_is_refused():
    class M(torch.nn.Module):
        def forward(self, x):
            return Scaled.apply(x, 1.5, x.shape[0])

    with pytest.raises(OnnxExportError, match="argument 'shift' of opaque::OnnxScaled is a "
                       "symbolic value"):
        torch_opaque.onnx.export(M(), (torch.randn(4, 3),), dynamic_shapes=({0: BATCH},))


def test_string_axis_names():
    proto = torch_opaque.onnx.export(Seed(), (torch.randn(4, 3),), dynamic_shapes=({0: "n"},))
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "n"
    assert_matches(proto, Seed(), torch.randn(6, 3))


def test_module_docstring_example():
    result = doctest.testmod(torch_opaque.onnx, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_in_place_ops_are_refused_clearly():
    """Note [In-place Functions]: an op with a mutable schema has no ONNX translation yet."""
    from opaque_fixtures import inplaceops

    with pytest.raises(OnnxExportError, match="torch_opaque.onnx: opaque::ArchScaleInPlace "
                       "modifies its arguments in place \\(ctx.mark_dirty\\); ONNX export of "
                       "in-place opaque ops is not supported yet"):
        torch_opaque.onnx.export(inplaceops.Net(), (torch.randn(3),))
