"""Nested torch.func transforms through wrapped Functions (Note [Nested grad] in
csrc/nested_grad.cpp): grad(grad(f)), hessian, jacfwd(jacrev(f)), jacrev(jacrev(f)),
vmap(grad(grad(f))), against the same Functions unwrapped (stock PyTorch)."""

import numpy as np
import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import torch_opaque
from torch_opaque._impl.function import _ORIGINAL_APPLY
from transform_cases import NAMES, compare, each_case


def sin_function(with_jvp, style="setup_context"):
    """A sine Function as packages write it; `generate_vmap_rule` so that stock
    supports every transform below."""

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x)

    def jvp_rule(ctx, t):
        (x,) = ctx.saved_tensors
        return t * torch.cos(x)

    body = {"generate_vmap_rule": True, "backward": staticmethod(backward)}
    if style == "setup_context":
        def forward(x):
            return torch.sin(x)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        body.update(forward=staticmethod(forward), setup_context=staticmethod(setup_context))
    else:
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.save_for_forward(x)
            return torch.sin(x)

        body["forward"] = staticmethod(forward)
    if with_jvp:
        body["jvp"] = staticmethod(jvp_rule)
    return type("NestedSin", (torch.autograd.Function,), body)


def pair(with_jvp=True):
    stock = sin_function(with_jvp)
    return (lambda t: _ORIGINAL_APPLY(stock, t)), torch_opaque.op(sin_function(with_jvp)).apply


def dbl(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=torch.double)


# f(v) -> scalar built on the Function: the output alone, and the output used
# again (its derivative at the outer level goes through the op's forward too).
SCALARS = {
    "plain": lambda f: (lambda v: f(v).sum()),
    "squared": lambda f: (lambda v: f(v).pow(2).sum()),
    "times_input": lambda f: (lambda v: (f(v) * v).sum()),
}

TRANSFORMS = {
    "grad(grad)": lambda s, x: vmap(grad(grad(s)))(x),
    "grad(grad(grad))": lambda s, x: vmap(grad(grad(grad(s))))(x),
    "hessian": lambda s, x: hessian(s)(x),
    "jacfwd(jacrev)": lambda s, x: jacfwd(jacrev(s))(x),
    "jacrev(jacrev)": lambda s, x: jacrev(jacrev(s))(x),
    "jvp(grad)": lambda s, x: jvp(grad(s), (x,), (torch.ones_like(x),))[1],
}


@pytest.mark.parametrize("scalar", sorted(SCALARS))
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_nested_transform_equals_stock(transform, scalar):
    ref, ours = pair()
    x = dbl(4)
    t, s = TRANSFORMS[transform], SCALARS[scalar]
    expected = t(s(ref), x)
    torch.testing.assert_close(t(s(ours), x), expected)
    assert expected.abs().sum() > 0  # a zero second derivative would prove nothing


def test_grad_of_grad_of_scalar_equals_analytic():
    _, ours = pair()
    x = torch.tensor(0.7, dtype=torch.double)
    torch.testing.assert_close(grad(grad(ours))(x), -torch.sin(x))
    torch.testing.assert_close(grad(grad(lambda v: ours(v).pow(2)))(x), 2 * torch.cos(2 * x))


def test_forward_style_function_nested_grad_equals_setup_context_stock():
    """Stock refuses forward(ctx, ...) Functions under torch.func; the op
    supports them, with the values of the setup_context twin."""
    ours = torch_opaque.op(sin_function(True, style="ctx")).apply
    ref, _ = pair()
    x = dbl(3)
    for t in ("grad(grad)", "hessian", "jacrev(jacrev)"):
        s = SCALARS["squared"]
        torch.testing.assert_close(TRANSFORMS[t](s(ours), x), TRANSFORMS[t](s(ref), x))


@pytest.mark.parametrize("transform", ["hessian", "jacfwd(jacrev)", "jvp(grad)"])
def test_forward_mode_without_jvp_raises_as_stock(transform):
    """The forward's tangent is needed (squared): a Function without jvp gives
    torch's own error, never a result missing that term."""
    ref, ours = pair(with_jvp=False)
    x = dbl(3)
    s, t = SCALARS["squared"], TRANSFORMS[transform]
    with pytest.raises(NotImplementedError) as stock_error:
        t(s(ref), x)
    with pytest.raises(NotImplementedError) as our_error:
        t(s(ours), x)
    assert str(our_error.value) == str(stock_error.value)


def test_create_graph_inside_grad_equals_stock():
    """torch.autograd.grad(create_graph=True) inside one grad level: the
    backward records at that level."""
    def outer(f):
        def g(v):
            v = v.requires_grad_() if not v.requires_grad else v
            (gv,) = torch.autograd.grad(f(v).sum(), v, create_graph=True)
            return gv.pow(2).sum()
        return grad(g)

    ref, ours = pair()
    x = dbl(3)
    torch.testing.assert_close(outer(ours)(x), outer(ref)(x))


def test_nested_grad_of_input_requiring_grad_is_differentiable():
    """grad(grad(f))(x) with x requiring grad: the result is differentiable by
    ordinary autograd, as stock's is."""
    def third(f):
        x = dbl(3).requires_grad_()
        h = vmap(grad(grad(lambda v: f(v).pow(2))))(x)
        (g,) = torch.autograd.grad(h.sum(), x)
        return h, g

    ref, ours = pair()
    for a, b in zip(third(ours), third(ref)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_corpus_grad_of_grad_matches_stock(name):
    """PyTorch's autograd.Function corpus under grad(grad(f)) (their backwards
    call other stock Functions: those see the transform level they run in)."""
    for g_ref, g, ts in each_case(name):
        def second(fn):
            first = grad(lambda *t: sum(o.sum() for o in fn(*t)))
            return grad(lambda *t: first(*t).pow(2).sum())

        compare(lambda: second(g_ref)(*ts), lambda: second(g)(*ts))


class NumpyBackwardSin(torch.autograd.Function):
    """Its backward leaves torch (numpy): it cannot run on torch.func's wrapped
    tensors, for the stock Function either."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.from_numpy(np.cos(x.detach().numpy()))


def test_numpy_backward_under_grad_raises_clearly():
    x = dbl(3)
    with pytest.raises(RuntimeError):
        grad(lambda v: _ORIGINAL_APPLY(NumpyBackwardSin, v).sum())(x)
    ours = torch_opaque.op(type("NumpyBackwardSinOp", (NumpyBackwardSin,), {}))
    with pytest.raises(RuntimeError, match=r"torch_opaque: .*the backward failed under a torch.func "
                       r"transform.*written with torch operations \(not numpy"):
        grad(lambda v: ours.apply(v).sum())(x)
    # Outside torch.func it works, as stock does.
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(ours.apply(xr).sum(), xr)
    torch.testing.assert_close(g, torch.cos(x))


# Their backwards call other stock Functions (NumpyMul, MulGenVmap).
STOCK_FUNCTION_IN_BACKWARD = ["MulGenVmapAutogradFunction", "NumpyCubeAutogradFunction"]

# Second-order transforms of f(first input) -> scalar that run the inner
# backward inside a transform level (per sample, or on batched tensors).
SECOND_ORDER = {
    "jacrev(jacrev)": lambda s, x: jacrev(jacrev(s))(x),
    "hessian": lambda s, x: hessian(s)(x),
    "vmap(grad(grad))": lambda s, x: vmap(grad(grad(s)))(torch.stack([x, 0.5 * x + 1.0])),
}


@pytest.mark.parametrize("transform", sorted(SECOND_ORDER))
@pytest.mark.parametrize("name", NAMES)
def test_corpus_second_order_transforms_match_stock(name, transform):
    """jacrev(jacrev(f)), hessian and vmap(grad(grad(f))) over PyTorch's corpus
    (Note [Nested grad]): the backward runs as user code of the level it runs
    in, so a stock Function it calls (MulGenVmap, NumpyMul) sees that level:
    values equal to stock's, or stock's kind of error (numpy code on
    transformed tensors)."""
    for g_ref, g, ts in each_case(name):
        def second(fn):
            def scalar(a):
                return sum(o.sum() for o in fn(a, *ts[1:]))
            return SECOND_ORDER[transform](scalar, ts[0])

        compare(lambda: second(g_ref), lambda: second(g))



@pytest.mark.parametrize("name", STOCK_FUNCTION_IN_BACKWARD)
def test_stock_function_in_backward_per_sample_in_a_level_matches_stock(name):
    """jacrev(jacrev(f)): the inner backward runs per sample inside a transform
    level and calls a stock Function there: stock's values (was a
    NotImplementedError)."""
    g_ref, g, ts = next(each_case(name))

    def second(fn):
        return jacrev(jacrev(lambda a: sum(o.pow(2).sum() for o in fn(a, *ts[1:]))))(ts[0])

    expected = second(g_ref)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(second(g), expected)


class ExpViaStockMul(torch.autograd.Function):
    """Neither vmap nor generate_vmap_rule (its op runs per sample under vmap);
    its backward calls a stock Function (the corpus's MulGenVmap)."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        from torch.testing._internal.autograd_function_db import MulGenVmap

        (y,) = ctx.saved_tensors
        return _ORIGINAL_APPLY(MulGenVmap, g, y)


def test_per_sample_backward_calling_a_stock_function_in_a_level():
    """The per-sample backward runs as user code of the level below (Note
    [Batching rules]): the stock Function it calls works there, and its
    operations record at the enclosing grad level (second derivatives of exp)."""
    ours = torch_opaque.op(type("ExpViaStockMulOp", (ExpViaStockMul,), {})).apply
    x = dbl(4)
    torch.testing.assert_close(jacrev(jacrev(lambda a: ours(a).sum()))(x), torch.diag(x.exp()))
    torch.testing.assert_close(jacrev(jacrev(lambda a: ours(a).pow(2).sum()))(x),
                               torch.diag(4 * (2 * x).exp()))
    torch.testing.assert_close(vmap(grad(grad(lambda a: ours(a).pow(2))))(x), 4 * (2 * x).exp())
