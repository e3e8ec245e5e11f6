"""vmap over wrapped Functions (Note [Batching rules] in torch_opaque/_impl/batching.py):
torch.func.jacrev, vmap(grad(f)), vmap of the forward, autograd.grad(is_grads_batched=True)
and autograd.functional.jacobian(vectorize=True), against the stock Function."""

import warnings

import pytest
import torch
from torch.func import grad, jacrev, vmap

import torch_opaque
from torch_opaque import UnsupportedError
from transform_cases import NAMES, compare, each_case, vmap_batch


@pytest.mark.parametrize("name", NAMES)
def test_jacrev_matches_stock(name):
    for g_ref, g, ts in each_case(name):
        argnums = tuple(range(len(ts)))
        compare(lambda: jacrev(g_ref, argnums)(*ts), lambda: jacrev(g, argnums)(*ts))


def summed(g):
    return lambda *t: sum(o.sum() for o in g(*t))


@pytest.mark.parametrize("name", NAMES)
def test_vmap_of_grad_matches_stock(name):
    """SelectGenVmap's forward returns a view of its input (was a RuntimeError)."""
    for g_ref, g, ts in each_case(name):
        batch, in_dims = vmap_batch(ts)
        compare(lambda: vmap(grad(summed(g_ref)), in_dims)(batch, *ts[1:]),
                lambda: vmap(grad(summed(g)), in_dims)(batch, *ts[1:]))


@pytest.mark.parametrize("name", NAMES)
def test_vmap_of_forward_matches_stock(name):
    for g_ref, g, ts in each_case(name):
        batch, in_dims = vmap_batch(ts)
        compare(lambda: vmap(g_ref, in_dims)(batch, *ts[1:]),
                lambda: vmap(g, in_dims)(batch, *ts[1:]))


def grads_batched_and_jacobian(g, ts):
    ts = tuple(t.clone().requires_grad_() for t in ts)
    outs = g(*ts)
    torch.manual_seed(1)
    vs = tuple(torch.randn(4, *o.shape) for o in outs)
    gb = torch.autograd.grad(outs, ts, vs, is_grads_batched=True, allow_unused=True)
    jac = torch.autograd.functional.jacobian(g, tuple(t.detach() for t in ts), vectorize=True)
    return gb, jac


@pytest.mark.parametrize("name", NAMES)
def test_is_grads_batched_and_vectorized_jacobian_match_stock(name):
    for g_ref, g, ts in each_case(name):
        compare(lambda: grads_batched_and_jacobian(g_ref, ts),
                lambda: grads_batched_and_jacobian(g, ts))


# ---- the three kinds of Function --------------------------------------------------

calls = {"vmap": 0, "forward": 0}


class ScaledSin(torch.autograd.Function):
    """A Function with its own vmap staticmethod (counts its calls)."""

    @staticmethod
    def forward(x, k):
        calls["forward"] += 1
        return x.sin() * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.k, None

    @staticmethod
    def vmap(info, in_dims, x, k):
        calls["vmap"] += 1
        x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        return ScaledSin.apply(x, k), 0


class GenCube(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        calls["forward"] += 1
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x ** 2


class Exp(torch.autograd.Function):
    """Neither vmap nor generate_vmap_rule, old forward(ctx, ...) style: stock refuses
    torch.func transforms for it; the op runs per sample."""

    @staticmethod
    def forward(ctx, x, scale: float):
        calls["forward"] += 1
        y = x.exp() * scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y, None


Wrapped = {c: torch_opaque.wrap(type(c.__name__ + "Op", (c,), {})) for c in (ScaledSin, GenCube)}
ExpOp = torch_opaque.wrap(type("ExpOp", (Exp,), {}))


@pytest.mark.parametrize("cls", [ScaledSin, GenCube], ids=lambda c: c.__name__)
def test_vmap_staticmethod_and_generated_rule_match_stock(cls):
    ours = Wrapped[cls]
    args = (lambda f: (lambda x: f(x, 2.0))) if cls is ScaledSin else (lambda f: f)
    x = torch.randn(3, 5)
    for transform in (vmap, lambda f: vmap(grad(lambda t: f(t).sum())), jacrev):
        torch.testing.assert_close(transform(args(ours.apply))(x), transform(args(cls.apply))(x))


def test_vmap_staticmethod_is_used():
    calls.update(vmap=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "performance drop" fallback warning
        vmap(lambda t: Wrapped[ScaledSin].apply(t, 2.0))(torch.randn(3, 5))
        vmap(grad(lambda t: Wrapped[ScaledSin].apply(t, 2.0).sum()))(torch.randn(3, 5))
    assert calls["vmap"] == 2


def test_per_sample_fallback_without_rule():
    x = torch.randn(4, 3)
    ExpOp.apply(x, 0.5)  # defines the op
    calls.update(forward=0)
    out = vmap(lambda t: ExpOp.apply(t, 0.5))(x)
    torch.testing.assert_close(out, x.exp() * 0.5)
    assert calls["forward"] == 4
    torch.testing.assert_close(vmap(grad(lambda t: ExpOp.apply(t, 0.5).sum()))(x), x.exp() * 0.5)
    torch.testing.assert_close(jacrev(lambda t: ExpOp.apply(t, 0.5))(x[0]),
                               torch.diag(x[0].exp() * 0.5))
    # in_dims None and batched/unbatched mixes: the backward's saved tensor is not batched
    y = x[0].clone().requires_grad_()
    (gb,) = torch.autograd.grad(ExpOp.apply(y, 0.5), y, torch.eye(3), is_grads_batched=True)
    torch.testing.assert_close(gb, torch.diag(y.detach().exp() * 0.5))


class SampleDependentState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = float(x.sum())
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_per_sample_state_that_differs_is_refused_clearly():
    op = torch_opaque.wrap(type("SampleDependentStateOp", (SampleDependentState,), {}))
    with pytest.raises(UnsupportedError, match="torch_opaque: .* under vmap: its forward, run "
                       "once per sample .* left different ctx state"):
        vmap(grad(lambda t: op.apply(t).sum()))(torch.randn(3, 2))


class DiagAffine(torch.autograd.Function):
    """generate_vmap_rule, written with views and broadcasting (transpose,
    diagonal, indexing, expand, diag_embed) of a batched and an unbatched
    argument: torch's own batching rules run on them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, b):
        calls["forward"] += 1
        return (x.t() * b).diagonal() + b[None, :].expand(2, -1).sum(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, b = ctx.saved_tensors
        return torch.diag_embed(g * b), g * x.diagonal() + 2 * g


DiagAffineOp = torch_opaque.wrap(type("DiagAffineOp", (DiagAffine,), {}))

GENERATED_TRANSFORMS = {
    "vmap x": lambda f, x, b: vmap(f, (0, None))(x, b),
    "vmap both": lambda f, x, b: vmap(f)(x, b.expand(x.shape[0], 3) * 1.5),
    "vmap(grad)": lambda f, x, b: vmap(grad(lambda u, v: f(u, v).sum(), (0, 1)), (0, None))(x, b),
    "jacrev": lambda f, x, b: jacrev(f, (0, 1))(x[0], b),
    "vmap(jacrev)": lambda f, x, b: vmap(jacrev(f, (0, 1)), (0, None))(x, b),
    "vmap(vmap)": lambda f, x, b: vmap(vmap(f, (0, None)), (0, None))(x.reshape(2, 2, 3, 3), b),
}


@pytest.mark.parametrize("transform", sorted(GENERATED_TRANSFORMS))
def test_generated_rule_runs_user_code_on_the_batch_as_stock(transform):
    """generate_vmap_rule = True: the user's code runs on batched tensors (as
    many calls as stock: once per vmap level, not once per sample), with
    stock's values."""
    torch.manual_seed(0)
    x, b = torch.randn(4, 3, 3), torch.randn(3)
    t = GENERATED_TRANSFORMS[transform]
    DiagAffineOp.apply(x[0], b)  # defines the op (its first call runs the forward)
    calls.update(forward=0)
    expected = t(DiagAffine.apply, x, b)
    stock_calls = calls["forward"]
    calls.update(forward=0)
    torch.testing.assert_close(t(DiagAffineOp.apply, x, b), expected)
    assert calls["forward"] == stock_calls


def test_generated_rule_forward_runs_once_under_vmap():
    x = torch.randn(5, 3)
    Wrapped[GenCube].apply(x)  # defines the op
    calls.update(forward=0)
    torch.testing.assert_close(vmap(Wrapped[GenCube].apply)(x), x ** 3)
    assert calls["forward"] == 1
