"""Acceptance 2: eager outputs, gradients and ctx behave as the original Function."""

from typing import Optional

import pytest
import torch
from torch.autograd.function import once_differentiable

import torch_opaque
from torch_opaque._impl.function import _ORIGINAL_APPLY


def original(cls, *args):
    """The unwrapped Function.apply of a wrapped class."""
    return _ORIGINAL_APPLY(cls, *args)


def grads_of(fn, inputs, outputs_to_sum=None):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [o for o in outs if o.requires_grad]
    total = sum((o * (i + 1)).sum() for i, o in enumerate(diff))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    gs = torch.autograd.grad(total, leaves, allow_unused=True)
    return outs, gs


def assert_same_as_original(cls, *inputs):
    ref_outs, ref_grads = grads_of(lambda *a: original(cls, *a), inputs)
    outs, grads = grads_of(cls.apply, inputs)
    assert len(outs) == len(ref_outs)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b)
        assert a.requires_grad == b.requires_grad
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b)


@torch_opaque.op
class Sin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def test_seed_values_grads_and_gradcheck():
    x = torch.randn(5, dtype=torch.double, requires_grad=True)
    assert_same_as_original(Sin, x)
    assert torch.autograd.gradcheck(Sin.apply, (x,))
    y = Sin.apply(x)
    assert y.grad_fn.name() == f"opaque::{torch_opaque.lookup(Sin).name}Backward"


@torch_opaque.op
class ScaledMulti(torch.autograd.Function):
    """Two outputs, non-tensor args, saved output + intermediate, ctx attributes."""

    @staticmethod
    def forward(ctx, x, y, alpha: float = 2.0, power=2):
        prod = x * y
        out1 = prod.pow(power) * alpha
        out2 = x.exp()
        ctx.save_for_backward(x, y, out2, prod)
        ctx.alpha = alpha
        ctx.power = power
        ctx.shape = x.shape
        ctx.dtype = x.dtype
        return out1, out2

    @staticmethod
    def backward(ctx, g1, g2):
        x, y, out2, prod = ctx.saved_tensors
        assert ctx.shape == x.shape and ctx.dtype == x.dtype
        d = g1 * ctx.alpha * ctx.power * prod.pow(ctx.power - 1)
        return d * y + g2 * out2, d * x, None, None


def test_multiple_outputs_saved_outputs_intermediates_attributes():
    x = torch.randn(4, dtype=torch.double, requires_grad=True)
    y = torch.randn(4, dtype=torch.double, requires_grad=True)
    assert_same_as_original(ScaledMulti, x, y, 3.0, 3)
    assert_same_as_original(ScaledMulti, x, y)  # defaults
    assert torch.autograd.gradcheck(lambda a, b: ScaledMulti.apply(a, b, 1.5, 2), (x, y))
    out = ScaledMulti.apply(x, y, alpha=0.5)  # keyword argument
    torch.testing.assert_close(out[0], (x * y).pow(2) * 0.5)


@torch_opaque.op
class NeedsGrad(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, a, b):
        NeedsGrad.seen.append(("fwd", ctx.needs_input_grad))
        return a * b

    @staticmethod
    def backward(ctx, g):
        NeedsGrad.seen.append(("bwd", ctx.needs_input_grad))
        return (g if ctx.needs_input_grad[0] else None), (g if ctx.needs_input_grad[1] else None)


def test_needs_input_grad_in_forward_and_backward():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    NeedsGrad.apply(a, b)  # the first call also runs forward once on fake tensors
    NeedsGrad.seen.clear()
    NeedsGrad.apply(a, b).sum().backward()
    assert NeedsGrad.seen == [("fwd", (True, False)), ("bwd", (True, False))]
    assert b.grad is None


@torch_opaque.op
class ArgMaxAndValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, idx = x.max(dim=-1)
        scaled = values * 2
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        ctx.n = x.shape[-1]
        return scaled, idx

    @staticmethod
    def backward(ctx, g, g_idx):
        (idx,) = ctx.saved_tensors
        assert g_idx is not None  # materialized (default)
        out = torch.zeros(*g.shape, ctx.n, dtype=g.dtype)
        return out.scatter(-1, idx.unsqueeze(-1), (2 * g).unsqueeze(-1))


def test_mark_non_differentiable_and_integer_outputs():
    x = torch.randn(3, 5, requires_grad=True)
    scaled, idx = ArgMaxAndValue.apply(x)
    assert scaled.requires_grad and not idx.requires_grad
    assert_same_as_original(ArgMaxAndValue, x)


@torch_opaque.op
class NoMaterialize(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        NoMaterialize.seen.append((g1 is None, g2 is None))
        out = 0
        if g1 is not None:
            out = out + 2 * g1
        if g2 is not None:
            out = out + 3 * g2
        return out


def test_set_materialize_grads_false_passes_none():
    x = torch.randn(3, requires_grad=True)
    NoMaterialize.seen.clear()
    a, _ = NoMaterialize.apply(x)
    a.sum().backward()
    assert NoMaterialize.seen == [(False, True)]
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


@torch_opaque.op
class Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_once_differentiable_backward():
    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    assert_same_as_original(Once, x)


@torch_opaque.op
class NoneGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_none_gradient_leaves_grad_unset():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    NoneGrad.apply(x, y).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3))
    assert y.grad is None


@torch_opaque.op
class SetupStyle(torch.autograd.Function):
    @staticmethod
    def forward(x, scale):
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale = inputs
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def test_setup_context_style():
    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    assert_same_as_original(SetupStyle, x, 4.0)


@torch_opaque.op
class Hinted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], k: int) -> torch.Tensor:
        ctx.has_bias = bias is not None
        return x * k + (bias if bias is not None else 0)

    @staticmethod
    def backward(ctx, g):
        return g * 1.0, (g if ctx.has_bias else None), None


def test_type_hints_give_one_schema_with_optional_tensor():
    fn = torch_opaque.lookup(Hinted)
    x = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    assert_same_as_original(Hinted, x, b, 2)
    assert_same_as_original(Hinted, x, None, 3)
    assert list(fn.overloads) == ["default"]
    schema = str(fn.overloads["default"].op._schema)
    assert schema.startswith(f"opaque::{fn.name}(Tensor x, Tensor? bias, SymInt k) -> Tensor")


@torch_opaque.op
class Unhinted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.has_bias = isinstance(bias, torch.Tensor)
        return x + (bias if bias is not None else 0)

    @staticmethod
    def backward(ctx, g):
        return g, (g if ctx.has_bias else None)


def test_argument_kinds_give_distinct_overloads():
    x = torch.randn(3, requires_grad=True)
    assert_same_as_original(Unhinted, x, torch.randn(3, requires_grad=True))
    assert_same_as_original(Unhinted, x, None)
    assert_same_as_original(Unhinted, x, 2.5)
    assert sorted(torch_opaque.lookup(Unhinted).overloads) == [
        "Tensor_None",
        "Tensor_Tensor",
        "Tensor_float",
    ]


@torch_opaque.op
class Kinds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, sizes, weights, flags, dtype, device, shape, name, maybe):
        ctx.save_for_backward(xs[0])
        ctx.meta = (dtype, device, shape, name, list(sizes), maybe)
        total = sum(x.sum() for x in xs) * weights[0]
        return torch.full(shape, 1.0, dtype=dtype, device=device) * total

    @staticmethod
    def backward(ctx, g):
        dtype, device, shape, name, sizes, maybe = ctx.meta
        assert isinstance(shape, torch.Size) and name == "hello" and maybe is None
        assert dtype == torch.float64 and device == torch.device("cpu")
        return (None,) * 9


def test_all_supported_argument_kinds():
    xs = [torch.randn(2), torch.randn(3)]
    args = (xs, [1, 2], [0.5, 1.5], [True, False], torch.float64, torch.device("cpu"),
            torch.Size([2, 2]), "hello", None)
    out = Kinds.apply(*args)
    ref = original(Kinds, *args)
    torch.testing.assert_close(out, ref)
    ov = next(iter(torch_opaque.lookup(Kinds).overloads.values()))
    assert str(ov.op._schema).startswith(
        f"opaque::{torch_opaque.lookup(Kinds).name}.Tensors_ints_floats_bools_dtype_device_size"
        "_str_None(Tensor[] xs, SymInt[] sizes, float[] weights, bool[] flags, "
        "ScalarType dtype, Device device, SymInt[] shape, str name, Tensor? maybe) -> Tensor"
    )
    # tensors inside lists are not differentiable inputs, as for autograd.Function
    leaf = torch.randn(2, requires_grad=True)
    assert not Kinds.apply([leaf], *args[1:]).requires_grad


@torch_opaque.op
class ReturnsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x, x.view(-1)

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 + g2.view_as(g1)


def test_outputs_aliasing_inputs_are_copied():
    x = torch.randn(2, 2, requires_grad=True)
    a, b = ReturnsInput.apply(x)
    assert not torch._C._is_alias_of(a, x) and not torch._C._is_alias_of(b, x)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((2, 2), 2.0))


def test_saved_tensor_modified_in_place_is_detected():
    leaf = torch.randn(3, requires_grad=True)
    x = leaf * 1
    y = Sin.apply(x)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_backward_twice_needs_retain_graph():
    x = torch.randn(3, requires_grad=True)
    y = Sin.apply(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    y2 = Sin.apply(x).sum()
    y2.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y2.backward()


def test_no_grad_and_inference_mode_skip_autograd():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert not Sin.apply(x).requires_grad
    with torch.inference_mode():
        torch.testing.assert_close(Sin.apply(torch.ones(2)), torch.ones(2).sin())


def test_user_exceptions_propagate_unchanged():
    @torch_opaque.op
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if x.sum() > 0:
                raise ValueError("forward says no")
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise KeyError("backward says no")

    with pytest.raises(ValueError, match="forward says no"):
        Boom.apply(torch.ones(2))
    y = Boom.apply(-torch.ones(2, requires_grad=True))
    with pytest.raises(KeyError, match="backward says no"):
        y.sum().backward()


@torch_opaque.op
class PassThroughMask(torch.autograd.Function):
    """Returns its mask input unchanged, marked non-differentiable, next to a
    differentiable output that saves a view of the input."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(x[0])  # a view of an input: becomes a copied residual
        return x * 2, mask

    @staticmethod
    def backward(ctx, g, g_mask):
        (first,) = ctx.saved_tensors
        return g * 2 + first * 0, None


def test_non_differentiable_output_that_is_an_input_stays_non_differentiable():
    x = torch.randn(3, requires_grad=True)
    mask = torch.rand(3, requires_grad=True)
    y, m = PassThroughMask.apply(x, mask)
    assert y.requires_grad and not m.requires_grad  # as with the original Function
    assert not torch._C._is_alias_of(m, mask)  # operator outputs never alias inputs
    torch.testing.assert_close(m, mask.detach())
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert mask.grad is None


def test_threads_each_get_their_own_ctx_and_record():
    import threading

    from opaque_fixtures.archops import ScaledSin  # sin(x) * scale, scale kept on ctx

    errors = []

    def work(k: float):
        try:
            for _ in range(200):
                x = torch.randn(8, requires_grad=True)
                (gx,) = torch.autograd.grad(ScaledSin.apply(x, k).sum(), x)
                torch.testing.assert_close(gx, x.detach().cos() * k)
        except Exception as e:  # reported below: threads swallow exceptions
            errors.append(e)

    threads = [threading.Thread(target=work, args=(float(k),)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
