"""Fake kernels, dynamic shapes and the error messages users see (acceptance 7)."""

import numpy as np
import pytest
import torch

import torch_opaque
from conftest import op_calls


class NumpyCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.from_numpy(np.asarray(x.detach().numpy()) ** 3)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


NumpyCubeWrapped = type("NumpyCubeWrapped", (NumpyCube,), {})
torch_opaque.wrap(NumpyCubeWrapped, name="NumpyCubeNoFake")


@torch_opaque.op(name="NumpyCubeFake")
class NumpyCubeWithFake(NumpyCube):
    @staticmethod
    def fake(ctx, x):
        ctx.save_for_backward(x)
        return torch.empty_like(x)


class M(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x) + 1


def test_forward_that_cannot_run_on_fake_tensors_works_eagerly():
    x = torch.randn(3, requires_grad=True)
    y = NumpyCubeWrapped.apply(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)


def test_export_error_names_the_function_and_the_fix():
    x = torch.randn(3)
    with pytest.raises(torch_opaque.FakeForwardError) as info:
        torch.export.export(M(NumpyCubeWrapped), (x,))
    msg = str(info.value)
    assert "NumpyCubeWrapped.forward cannot run on fake tensors while tracing" in msg
    assert "add a `fake` staticmethod to NumpyCubeWrapped" in msg


def test_user_fake_is_used_for_tracing_and_training():
    x = torch.randn(3)
    ep = torch.export.export(
        M(NumpyCubeWithFake), (x,), dynamic_shapes=({0: torch.export.Dim("n")},)
    )
    assert len(op_calls(ep.graph_module, "NumpyCubeFake")) == 1
    y = torch.randn(5, requires_grad=True)
    out = ep.module()(y)
    torch.testing.assert_close(out, y.detach() ** 3 + 1)
    out.sum().backward()
    torch.testing.assert_close(y.grad, 3 * y.detach() ** 2)


@torch_opaque.op(name="ShapeState")
class ShapeState(torch.autograd.Function):
    """Keeps a symbolic size on ctx: it travels as a SymInt argument."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0]
        return x.sum(0)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(0).expand(ctx.n, *g.shape)


def test_symbolic_ctx_state_under_dynamic_compile():
    f = torch.compile(lambda x: ShapeState.apply(x), backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (3, 5):
        x = torch.randn(n, 2, requires_grad=True)
        f(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(n, 2))


def test_unsupported_argument_type_is_named():
    @torch_opaque.op
    class TakesDict(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cfg):
            return x * cfg["k"]

        @staticmethod
        def backward(ctx, g):
            return g, None

    with pytest.raises(torch_opaque.SchemaError, match="argument 'cfg' has type dict"):
        TakesDict.apply(torch.ones(2), {"k": 2})


def test_unsupported_annotation_is_named_when_wrapping():
    class BadHint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, cfg: dict):
            return x

        @staticmethod
        def backward(ctx, g):
            return g, None

    with pytest.raises(torch_opaque.SchemaError, match="argument 'cfg' is annotated as"):
        torch_opaque.wrap(BadHint)


def test_mark_dirty_from_a_helper_is_refused_clearly():
    # in-place Functions are recognised by ctx.mark_dirty in forward itself
    def mark(ctx, t):
        ctx.mark_dirty(t)

    @torch_opaque.op
    class InPlaceViaHelper(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            mark(ctx, x)
            return x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    with pytest.raises(RuntimeError, match=r"ctx.mark_dirty\(\) was called from code other "
                       r"than the Function's own forward"):
        InPlaceViaHelper.apply(torch.ones(2))


def test_unrepresentable_ctx_attribute_is_named_when_traced():
    @torch_opaque.op
    class KeepsObject(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.helper = object()
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    # eager: the object reaches the backward as it is (test_ctx_exactness.py)
    x = torch.ones(2, requires_grad=True)
    KeepsObject.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0))
    # a traced training graph would have to carry it: refused, naming the attribute
    f = torch.compile(KeepsObject.apply, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="ctx.helper holds a object, which a traced graph cannot carry"):
        f(torch.ones(2, requires_grad=True))
    torch.testing.assert_close(KeepsObject.apply(torch.ones(2)), torch.full((2,), 2.0))


def test_wrong_number_of_gradients_is_named():
    @torch_opaque.op
    class TooFew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    out = TooFew.apply(torch.ones(2, requires_grad=True), torch.ones(2))
    with pytest.raises(RuntimeError, match=r"TooFew.backward returned an incorrect number of gradients \(expected 2, got 1\)"):
        out.sum().backward()


def test_gradient_for_non_tensor_argument_is_named():
    @torch_opaque.op
    class GradForFloat(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k: float):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g, g

    out = GradForFloat.apply(torch.ones(2, requires_grad=True), 2.0)
    with pytest.raises(RuntimeError, match="forward input 'k' is not a Tensor"):
        out.sum().backward()


def test_non_tensor_output_is_named():
    @torch_opaque.op
    class ReturnsInt(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, 3

        @staticmethod
        def backward(ctx, g, _):
            return g

    with pytest.raises(torch_opaque.SchemaError, match="returned a int as output 1; opaque ops return tensors only"):
        ReturnsInt.apply(torch.ones(2))


def test_not_a_function_and_missing_backward():
    with pytest.raises(TypeError, match="expected a torch.autograd.Function subclass"):
        torch_opaque.wrap(object)

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    with pytest.raises(TypeError, match="defines no backward"):
        torch_opaque.wrap(NoBackward)


@torch_opaque.op(name="Square")
class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_forward_mode_ad_without_jvp_gives_torchs_error():
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn(3), torch.ones(3))
        with pytest.raises(NotImplementedError, match="You must implement the jvp function"):
            Square.apply(dual)
