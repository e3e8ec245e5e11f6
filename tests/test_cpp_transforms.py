"""torch.func transforms on ops written in C++ (examples/cpp): forward-mode AD
through an op's `jvp` (Note [C++ jvp] in include/torch_opaque/detail/jvp_finisher.h)
and vmap through the per-sample batching kernel (Note [Per-sample batching]
in csrc/per_sample_batching.cpp). References are the same ops written with
ATen ops, and finite differences (gradcheck).
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp, vmap

pytestmark = pytest.mark.usefixtures("example_ops")

def polar(r, theta):
    return torch.ops.example.polar(r, theta)


def polar_ref(r, theta):
    return r * theta.cos(), r * theta.sin()


def scaled_sin(x):
    return torch.ops.example.scaled_sin(x, 1.5)


def scaled_sin_ref(x):
    return x.sin() * 1.5


def rand(*shape):
    return torch.randn(*shape, dtype=torch.double)


# ---- forward-mode AD ----------------------------------------------------------


def test_jvp_op_schema():
    assert str(torch.ops.example.polar_jvp.default._schema) == (
        "example::polar_jvp(Tensor r, Tensor theta, Tensor?[] tangents) -> (Tensor, Tensor, Tensor[])"
    )
    with pytest.raises(RuntimeError):  # an op without jvp gets no `_jvp`
        torch._C._get_schema("example::scaled_sin_jvp", "")


def test_func_jvp_matches_aten_reference():
    r, th, tr, tth = rand(3, 4), rand(3, 4), rand(3, 4), rand(3, 4)
    out, tangents = jvp(polar, (r, th), (tr, tth))
    ref_out, ref_tangents = jvp(polar_ref, (r, th), (tr, tth))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(tangents, ref_tangents)


def test_dual_tensors_with_a_tangent_on_one_argument():
    r, th, tth = rand(5), rand(5), rand(5)
    with fwAD.dual_level():
        x, y = polar(r, fwAD.make_dual(th, tth))
        tx, ty = fwAD.unpack_dual(x).tangent, fwAD.unpack_dual(y).tangent
    with fwAD.dual_level():
        xr, yr = polar_ref(r, fwAD.make_dual(th, tth))
        txr, tyr = fwAD.unpack_dual(xr).tangent, fwAD.unpack_dual(yr).tangent
    torch.testing.assert_close((x, y), (xr, yr))
    torch.testing.assert_close((tx, ty), (txr, tyr))


def test_forward_ad_equals_finite_differences():
    r = rand(4).requires_grad_()
    th = rand(4).requires_grad_()
    assert torch.autograd.gradcheck(polar, (r, th), check_forward_ad=True)


def test_forward_and_reverse_mode_together():
    """A dual tensor that also requires grad: the tangents come from `_jvp`,
    the gradients from `_fwd`/`_bwd`."""
    r, th = rand(3).requires_grad_(), rand(3).requires_grad_()
    tr = rand(3)
    with fwAD.dual_level():
        x, y = polar(fwAD.make_dual(r, tr), th)
        tx = fwAD.unpack_dual(x).tangent
    torch.testing.assert_close(tx, tr * th.detach().cos())
    (x + y).sum().backward()
    torch.testing.assert_close(r.grad, (th.cos() + th.sin()).detach())
    torch.testing.assert_close(th.grad, (r * (th.cos() - th.sin())).detach())


def test_jacfwd_equals_jacrev_of_the_reference():
    r, th = rand(4), rand(4)
    for argnums in (0, 1):
        got = jacfwd(polar, argnums=argnums)(r, th)
        ref = jacrev(polar_ref, argnums=argnums)(r, th)
        torch.testing.assert_close(got, ref)


def test_op_without_jvp_raises_torchs_error():
    x, t = rand(3), rand(3)
    with pytest.raises(NotImplementedError, match="You must implement the jvp function"):
        jvp(scaled_sin, (x,), (t,))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="You must implement the jvp function"):
            scaled_sin(fwAD.make_dual(x, t))


# ---- vmap -----------------------------------------------------------------------


def test_vmap_matches_aten_reference():
    x = rand(3, 5, 2)
    for in_dims in (0, 1, 2):
        torch.testing.assert_close(vmap(scaled_sin, in_dims)(x), vmap(scaled_sin_ref, in_dims)(x))
    r, th = rand(4, 3), rand(3)
    got = vmap(polar, in_dims=(0, None))(r, th)
    torch.testing.assert_close(got, polar_ref(r, th.expand(4, 3)))


def test_vmap_of_two_outputs_and_int_outputs():
    x = rand(6, 3, 4)
    values, idx = vmap(lambda t: torch.ops.example.top_value(t, 1))(x)
    ref = x.max(2)
    torch.testing.assert_close(values, ref.values)
    assert torch.equal(idx, ref.indices)


def test_vmap_of_a_data_ptr_kernel():
    x = torch.randn(4, 5)
    torch.testing.assert_close(vmap(torch.ops.example.square_loop)(x), x * x)


def test_vmap_of_tensor_list_ops():
    xs = [rand(3, 4) for _ in range(2)]
    w = rand(2)
    got = vmap(lambda a, b: torch.ops.example.weighted_sum([a, b], w))(*xs)
    torch.testing.assert_close(got, xs[0] * w[0] + xs[1] * w[1])
    x = rand(3, 5)
    means = vmap(lambda t: torch.ops.example.power_means(t, [1, 2]))(x)
    torch.testing.assert_close(means, [x.mean(-1), (x * x).mean(-1)])


def test_jacrev_matches_aten_reference():
    x = rand(5)
    torch.testing.assert_close(jacrev(scaled_sin)(x), jacrev(scaled_sin_ref)(x))
    r, th = rand(3), rand(3)
    torch.testing.assert_close(jacrev(polar, argnums=(0, 1))(r, th), jacrev(polar_ref, argnums=(0, 1))(r, th))
    x = rand(2, 4)
    got = jacrev(lambda t: torch.ops.example.top_value(t, 1)[0])(x)
    ref = jacrev(lambda t: t.max(1).values)(x)
    torch.testing.assert_close(got, ref)


def test_vmap_of_grad_matches_aten_reference():
    x = rand(4, 3)
    got = vmap(grad(lambda t: scaled_sin(t).sum()))(x)
    ref = vmap(grad(lambda t: scaled_sin_ref(t).sum()))(x)
    torch.testing.assert_close(got, ref)
    r, th = rand(4, 3), rand(4, 3)
    f = lambda fn: vmap(grad(lambda a, b: sum(o.pow(2).sum() for o in fn(a, b)), argnums=(0, 1)))
    torch.testing.assert_close(f(polar)(r, th), f(polar_ref)(r, th))


def test_vmap_of_jvp():
    r, th, tr, tth = rand(3, 2), rand(3, 2), rand(3, 2), rand(3, 2)
    got = vmap(lambda *a: jvp(polar, a[:2], a[2:]))(r, th, tr, tth)
    ref = vmap(lambda *a: jvp(polar_ref, a[:2], a[2:]))(r, th, tr, tth)
    torch.testing.assert_close(got, ref)


def test_hessian_of_an_op_with_jvp():
    r, th = rand(3), rand(3)
    f = lambda fn: (lambda a, b: fn(a, b)[0].sum() + fn(a, b)[1].pow(2).sum())
    torch.testing.assert_close(
        torch.func.hessian(f(polar), argnums=1)(r, th), torch.func.hessian(f(polar_ref), argnums=1)(r, th)
    )


def test_nested_vmap_with_arguments_batched_at_different_levels():
    """The kernel unwraps the highest level its arguments are batched at
    (Note [Per-sample batching]); arguments batched only at an outer level,
    seen at an inner one, give what that level would."""
    r, th = rand(2, 3, 4), rand(3, 4)

    def nested(fn):
        both = vmap(lambda a: vmap(fn)(a, th))(r)  # r at both levels, th at the inner
        mixed = vmap(lambda b: vmap(lambda x: fn(x, b))(r[0]))(th)  # th outer, r inner
        outer_only = vmap(lambda b: vmap(lambda x: fn(r[0, 0], b)[0] + x)(r[0, 0]))(th)
        return both, mixed, outer_only

    torch.testing.assert_close(nested(polar), nested(polar_ref))


def test_second_derivatives_under_vmap():
    th = rand(3, 4)

    def f(fn):
        return lambda a: fn(a, a)[1].sum()

    torch.testing.assert_close(vmap(torch.func.hessian(f(polar)))(th), vmap(torch.func.hessian(f(polar_ref)))(th))
    torch.testing.assert_close(jacrev(jacrev(f(polar)))(th[0]), jacrev(jacrev(f(polar_ref)))(th[0]))


def test_is_grads_batched_and_vectorized_jacobian():
    """torch's older vmap (the Batched key) runs the C++ backward and jvp on its
    batched tensors."""
    x = rand(3, 4).requires_grad_()
    eye = torch.eye(12, dtype=torch.double).reshape(12, 3, 4)
    (g,) = torch.autograd.grad(scaled_sin(x), x, eye, is_grads_batched=True)
    torch.testing.assert_close(g, eye * x.detach().cos() * 1.5)
    t = x.detach()
    ref = torch.autograd.functional.jacobian(lambda a: a * a.cos(), t)
    for strategy in ("reverse-mode", "forward-mode"):
        got = torch.autograd.functional.jacobian(
            lambda a: polar(a, a)[0], t, vectorize=True, strategy=strategy
        )
        torch.testing.assert_close(got, ref)


def test_compiled_jvp_and_vmap():
    r, th = rand(4), rand(4)
    ones = torch.ones_like(r)

    def f(fn):
        return lambda a, b: jvp(fn, (a, b), (ones, ones))

    torch.testing.assert_close(
        torch.compile(f(polar), backend="aot_eager", fullgraph=True)(r, th), f(polar_ref)(r, th)
    )
    x = rand(3, 4)
    torch.testing.assert_close(
        torch.compile(vmap(scaled_sin), backend="aot_eager", fullgraph=True)(x), scaled_sin_ref(x)
    )


# ---- error cases (tests/cpp/transform_test_ops.cpp) ------------------------------


@pytest.fixture(scope="module")
def transform_test_ops():
    import torch_opaque
    from support.build_tree import TEST_LIBS, missing

    lib = TEST_LIBS / "libtransform_test_ops.so"
    assert lib.exists(), missing(lib)
    torch_opaque.load_library(lib)
    return torch.ops.opaque_transform_test


def test_vmap_of_grad_refuses_per_sample_state_that_differs(transform_test_ops):
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    # Without a backward, nothing is recorded: plain vmap works.
    torch.testing.assert_close(vmap(transform_test_ops.scale_by_max)(x), x * x.max(1, keepdim=True).values)
    # A gradient per sample: each sample's forward keeps its own max in saved_data.
    with pytest.raises(RuntimeError, match="left different ctx state or saved tensors for different samples"):
        vmap(grad(lambda t: transform_test_ops.scale_by_max(t).sum()))(x)
    # The same state in every sample is fine.
    y = torch.tensor([[1.0, 5.0], [5.0, 2.0]])
    torch.testing.assert_close(vmap(grad(lambda t: transform_test_ops.scale_by_max(t).sum()))(y), torch.full_like(y, 5.0))


def test_jvp_tangent_of_the_wrong_shape_is_a_clear_error(transform_test_ops):
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match=r"jvp returned a tangent of shape \[\] for output 0 of shape \[3\]"):
        jvp(transform_test_ops.wrong_tangent_shape, (x,), (torch.randn(3),))


class CountCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of one op that reach the Python key (below vmap's)."""

    def __init__(self, name):
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == self.name:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_batched_forward_runs_once_per_batch(transform_test_ops):
    op = transform_test_ops.cumsum_scaled
    x, y = rand(5, 3, 4), rand(4)
    for fn, args, in_dims, ref in [
        (lambda a: op(a, 2.0), (x,), 0, x.cumsum(-1) * 2),
        (lambda a, b: op(a + b, 2.0), (x, y), (0, None), (x + y).cumsum(-1) * 2),
    ]:
        with CountCalls("opaque_transform_test::cumsum_scaled") as mode:
            got = vmap(fn, in_dims)(*args)
        torch.testing.assert_close(got, ref)
        assert mode.count == 0  # no per-sample call of the op
    # An argument batched elsewhere than dim 0.
    got = vmap(lambda a: op(a, 0.5), in_dims=1)(x)
    torch.testing.assert_close(got, x.movedim(1, 0).cumsum(-1) * 0.5)
    # A scaled_sin without a batched forward runs once per sample.
    with CountCalls("example::scaled_sin") as mode:
        vmap(scaled_sin)(x)
    assert mode.count == 5
    # Gradients: `_fwd`/`_bwd` per sample, and plain autograd through the batch.
    g = vmap(grad(lambda a: op(a, 2.0).pow(2).sum()))(x)
    ref = vmap(grad(lambda a: (a.cumsum(-1) * 2).pow(2).sum()))(x)
    torch.testing.assert_close(g, ref)
    xr = x.clone().requires_grad_()
    vmap(lambda a: op(a, 2.0))(xr).pow(2).sum().backward()
    torch.testing.assert_close(xr.grad, ref)
    g = grad(lambda a: vmap(lambda t: op(t, 2.0))(a).pow(2).sum())(x)
    torch.testing.assert_close(g, ref)


def test_batched_forward_that_drops_the_batch_is_a_clear_error(transform_test_ops):
    with pytest.raises(RuntimeError, match=r"its batched_forward returned an output of shape \[12\] for a batch of 3"):
        vmap(transform_test_ops.bad_batched)(torch.randn(3, 4))
