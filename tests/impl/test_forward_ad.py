"""Forward-mode AD through wrapped Functions (Note [Forward-mode AD] in
torch_opaque/_impl/forward_ad.py): torch.func.jvp, jacfwd and
torch.autograd.forward_ad dual tensors against the stock Function and finite
differences."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import jacfwd, jvp

import torch_opaque
from transform_cases import NAMES, compare, each_case


def tangents_like(ts):
    torch.manual_seed(2)
    return tuple(torch.randn_like(t) for t in ts)


@pytest.mark.parametrize("name", NAMES)
def test_func_jvp_and_jacfwd_match_stock(name):
    for g_ref, g, ts in each_case(name):
        tan = tangents_like(ts)
        compare(lambda: jvp(g_ref, ts, tan), lambda: jvp(g, ts, tan))
        argnums = tuple(range(len(ts)))
        compare(lambda: jacfwd(g_ref, argnums)(*ts), lambda: jacfwd(g, argnums)(*ts))


def dual_outputs(g, ts):
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, d) for t, d in zip(ts, tangents_like(ts))]
        return [tuple(fwAD.unpack_dual(o)) for o in g(*duals)]


@pytest.mark.parametrize("name", NAMES)
def test_dual_tensors_match_stock(name):
    for g_ref, g, ts in each_case(name):
        compare(lambda: dual_outputs(g_ref, ts), lambda: dual_outputs(g, ts))


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.k = k
        return k * x ** 3, x.exp()

    @staticmethod
    def backward(ctx, g1, g2):
        (x,) = ctx.saved_tensors
        return 3 * ctx.k * x ** 2 * g1 + x.exp() * g2, None

    @staticmethod
    def jvp(ctx, t, _):
        (x,) = ctx.saved_tensors
        return 3 * ctx.k * x ** 2 * t, x.exp() * t


CubeOp = torch_opaque.wrap(type("CubeOp", (Cube,), {}))


def test_jvp_matches_finite_differences():
    x = torch.randn(5, dtype=torch.float64)
    t = torch.randn(5, dtype=torch.float64)
    eps = 1e-6
    fd = [(a - b) / (2 * eps) for a, b in zip(CubeOp.apply(x + eps * t, 0.5),
                                                CubeOp.apply(x - eps * t, 0.5))]
    _, tangents = jvp(lambda v: CubeOp.apply(v, 0.5), (x,), (t,))
    torch.testing.assert_close(tangents, tuple(fd), rtol=1e-6, atol=1e-6)
    torch.autograd.gradcheck(lambda v: CubeOp.apply(v, 0.5), (x.requires_grad_(),),
                             check_forward_ad=True, check_backward_ad=True, check_batched_grad=True)


def test_forward_and_reverse_together():
    """Dual tensors that also require grad: tangents and gradients both right."""
    x = torch.randn(4, requires_grad=True)
    t = torch.randn(4)
    with fwAD.dual_level():
        y, e = CubeOp.apply(fwAD.make_dual(x, t), 2.0)
        ty = fwAD.unpack_dual(y).tangent
        (y.sum() + e.sum()).backward()
    torch.testing.assert_close(ty, 6 * x.detach() ** 2 * t)
    torch.testing.assert_close(x.grad, 6 * x.detach() ** 2 + x.detach().exp())


class NoJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_function_without_jvp_gives_torchs_error():
    ours = torch_opaque.wrap(type("NoJvpOp", (NoJvp,), {}))
    x, t = torch.randn(3), torch.ones(3)
    for fn in (NoJvp.apply, ours.apply):
        with pytest.raises(NotImplementedError, match="You must implement the jvp function "
                           "for custom autograd.Function to use it with forward mode AD"):
            with fwAD.dual_level():
                fn(fwAD.make_dual(x, t))
        with pytest.raises(NotImplementedError, match="You must implement the jvp function"):
            jvp(fn, (x,), (t,))


def test_exported_jvp_keeps_one_op_node():
    """torch.export keeps torch.func.jvp as functorch calls around the one op
    node; ep.module() computes the tangent through the op's jvp."""
    class M(torch.nn.Module):
        def forward(self, x, t):
            return jvp(lambda v: CubeOp.apply(v, 0.5)[0], (x,), (t,))

    x, t = torch.randn(3), torch.randn(3)
    ep = torch.export.export(M(), (x, t))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    name = torch_opaque.lookup(CubeOp).name
    assert [str(t) for t in targets if "opaque" in str(t)] == [f"opaque.{name}.Tensor_float"]
    torch.testing.assert_close(ep.module()(x, t), M()(x, t))


def _partial_mul(materialize):
    seen = []

    class PartialMul(torch.autograd.Function):
        @staticmethod
        def forward(x, y):
            return x * y

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_forward(*inputs)
            ctx.set_materialize_grads(materialize)

        @staticmethod
        def backward(ctx, g):
            raise AssertionError("not used")

        @staticmethod
        def jvp(ctx, tx, ty):
            seen.append(ty if ty is None else ty.clone())
            x, y = ctx.saved_tensors
            return tx * y if ty is None else tx * y + ty * x

    return PartialMul, seen


@pytest.mark.parametrize("materialize", [True, False])
def test_input_without_tangent_reaches_jvp_as_stock(materialize):
    """An input without a tangent reaches jvp as zeros (None when
    ctx.set_materialize_grads(False)), as in stock."""
    x, y = torch.randn(3), torch.randn(3)
    results = []
    for wrap in (False, True):
        cls, seen = _partial_mul(materialize)
        f = torch_opaque.op(cls).apply if wrap else cls.apply
        out = jvp(lambda a: f(a, y), (x,), (torch.ones(3),))[1]
        results.append((out, seen))
    (ref, ref_seen), (ours, our_seen) = results
    torch.testing.assert_close(ours, ref)
    assert [t is None for t in our_seen] == [t is None for t in ref_seen] == [not materialize]
    for a, b in zip(our_seen, ref_seen):
        if a is not None:
            torch.testing.assert_close(a, b)
