"""Fakes from real runs on stand-in data (Note [Fake from a real run] in
torch_opaque/_impl/fake_from_real.py): forwards that branch on their data but
whose output shapes follow the inputs export as one opaque node; a forward
whose output shape depends on the data gets the FakeForwardError (wrap) or
falls back (auto())."""

import math
import warnings

import pytest
import torch
from torch.export import Dim

import torch_opaque
from conftest import op_calls


# ---- sparsemax, as entmax writes it (entmax/activations.py) ----------------------


def _make_ix_like(X, dim):
    d = X.size(dim)
    rho = torch.arange(1, d + 1, device=X.device, dtype=X.dtype)
    view = [1] * X.dim()
    view[0] = -1
    return rho.view(view).transpose(0, dim)


def _roll_last(X, dim):
    if dim == -1:
        return X
    elif dim < 0:
        dim = X.dim() - dim
    perm = [i for i in range(X.dim()) if i != dim] + [dim]
    return X.permute(perm)


def _sparsemax_threshold_and_support(X, dim=-1, k=None):
    if k is None or k >= X.shape[dim]:  # do full sort
        topk, _ = torch.sort(X, dim=dim, descending=True)
    else:
        topk, _ = torch.topk(X, k=k, dim=dim)

    topk_cumsum = topk.cumsum(dim) - 1
    rhos = _make_ix_like(topk, dim)
    support = rhos * topk > topk_cumsum

    support_size = support.sum(dim=dim).unsqueeze(dim)
    tau = topk_cumsum.gather(dim, support_size - 1)
    tau /= support_size.to(X.dtype)

    if k is not None and k < X.shape[dim]:
        unsolved = (support_size == k).squeeze(dim)

        if torch.any(unsolved):
            in_ = _roll_last(X, dim)[unsolved]
            tau_, ss_ = _sparsemax_threshold_and_support(in_, dim=-1, k=2 * k)
            _roll_last(tau, dim)[unsolved] = tau_
            _roll_last(support_size, dim)[unsolved] = ss_

    return tau, support_size


class SparsemaxFunction(torch.autograd.Function):
    @classmethod
    def forward(cls, ctx, X, dim=-1, k=None):
        ctx.dim = dim
        max_val, _ = X.max(dim=dim, keepdim=True)
        X = X - max_val  # same numerical stability trick as softmax
        tau, supp_size = _sparsemax_threshold_and_support(X, dim=dim, k=k)
        output = torch.clamp(X - tau, min=0)
        ctx.save_for_backward(supp_size, output)
        return output

    @classmethod
    def backward(cls, ctx, grad_output):
        supp_size, output = ctx.saved_tensors
        dim = ctx.dim
        grad_input = grad_output.clone()
        grad_input[output == 0] = 0

        v_hat = grad_input.sum(dim=dim) / supp_size.to(output.dtype).squeeze(dim)
        v_hat = v_hat.unsqueeze(dim)
        grad_input = torch.where(output != 0, grad_input - v_hat, grad_input)
        return grad_input, None, None


# ---- LogNormalCDF, as gpytorch writes it (gpytorch/functions/_log_normal_cdf.py) ----


class LogNormalCDF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        c = torch.tensor(
            [0.00048204, -0.00142906, 0.0013200243174, 0.0009461589032, -0.0045563339802,
             0.00556964649138, 0.00125993961762116, -0.01621575378835404, 0.02629651521057465,
             -0.001829764677455021, 2 * (1 - math.pi / 3), (4 - math.pi) / 3, 1, 1],
            dtype=z.dtype, device=z.device,
        )
        r = torch.tensor(
            [1.2753666447299659525, 5.019049726784267463450, 6.1602098531096305441,
             7.409740605964741794425, 2.9788656263939928886],
            dtype=z.dtype, device=z.device,
        )
        q = torch.tensor(
            [2.260528520767326969592, 9.3960340162350541504, 12.048951927855129036034,
             17.081440747466004316, 9.608965327192787870698, 3.3690752069827527677],
            dtype=z.dtype, device=z.device,
        )

        log_phi_z = torch.zeros_like(z)

        # Three cases to handle: An entry of z is near zero, an entry of z is small, or an entry of z neither of these.
        z_near_zero = z.pow(2).lt(0.04)
        z_is_small = z.lt(-1)
        z_is_ordinary = ~(z_near_zero | z_is_small)

        # Case 1: Entries of z that are near zero
        if z_near_zero.sum() > 0:
            log_phi_first = -z.masked_select(z_near_zero).div_(math.sqrt(2 * math.pi))
            f = 0
            for c_i in c.tolist():
                f = log_phi_first.mul(c_i + f)

            log_phi_z.masked_scatter_(z_near_zero, f.mul_(-2).sub_(math.log(2)))

        # Case 2: Entries of z that are very small
        if z_is_small.sum() > 0:
            z_where_z_is_small = z.masked_select(z_is_small)
            numerator = torch.tensor(0.5641895835477550741, dtype=z.dtype, device=z.device)
            numerator = numerator.expand_as(z_where_z_is_small)
            denominator = torch.tensor(1.0, dtype=z.dtype, device=z.device)
            denominator = denominator.expand_as(z_where_z_is_small)

            for r_i in r:
                numerator = -z_where_z_is_small.mul(numerator.div(math.sqrt(2))) + r_i

            for q_i in q:
                denominator = -z_where_z_is_small.mul(denominator.div(math.sqrt(2))) + q_i

            e = numerator.div(denominator)
            log_phi_z.masked_scatter_(z_is_small, torch.log(e / 2) - z_where_z_is_small.pow(2).div_(2))

            ctx.denominator = denominator
            ctx.numerator = numerator

        log_phi_z.masked_scatter_(
            z_is_ordinary, torch.log(torch.distributions.Normal(0.0, 1.0).cdf(z.masked_select(z_is_ordinary)))
        )

        ctx.save_for_backward(z, log_phi_z)
        return log_phi_z

    @staticmethod
    def backward(ctx, grad_output):
        z, log_phi_z = ctx.saved_tensors
        log_phi_z_grad = torch.zeros_like(z)

        z_is_small = z.lt(-1)
        z_is_not_small = ~z_is_small

        if z_is_small.sum() > 0:
            log_phi_z_grad[z_is_small] = torch.abs(ctx.denominator.div(ctx.numerator)).mul(math.sqrt(2 / math.pi))

        exp = z[z_is_not_small].pow(2).div(-2).sub(log_phi_z[z_is_not_small]).add(math.log(0.5))

        log_phi_z_grad[z_is_not_small] = torch.exp(exp).mul(math.sqrt(2 / math.pi))

        return log_phi_z_grad.mul(grad_output)


# ---- an iterative solver with a data-dependent stopping rule (qpth's style) ----------


def _cg(M, b, tol=1e-10, max_iter=200):
    """Conjugate gradients on M x = b (columns of b), until the residual is small."""
    x = torch.zeros_like(b)
    r = b - M @ x
    p = r.clone()
    rs = (r * r).sum(0)
    it = 0
    while rs.sqrt().max() > tol and it < max_iter:
        Mp = M @ p
        alpha = rs / (p * Mp).sum(0)
        x = x + alpha * p
        r = r - alpha * Mp
        rs_new = (r * r).sum(0)
        p = r + (rs_new / rs) * p
        rs = rs_new
        it += 1
    return x


class SPDSolve(torch.autograd.Function):
    """x = (A A^T + n I)^-1 b by conjugate gradients; implicit backward."""

    @staticmethod
    def forward(ctx, A, b):
        n = A.shape[0]
        M = A @ A.t() + n * torch.eye(n, dtype=A.dtype, device=A.device)
        x = _cg(M, b)
        ctx.save_for_backward(A, M, x)
        return x

    @staticmethod
    def backward(ctx, grad_x):
        A, M, x = ctx.saved_tensors
        gb = _cg(M, grad_x)
        gM = -gb @ x.t()
        return (gM + gM.t()) @ A, gb


# ---- helpers ------------------------------------------------------------------------


class Call(torch.nn.Module):
    def __init__(self, fn, *consts):
        super().__init__()
        self.fn, self.consts = fn, consts

    def forward(self, *xs):
        return self.fn.apply(*xs, *self.consts)


# name -> (Function, constant arguments, inputs of batch size n)
CASES = {
    "sparsemax": (SparsemaxFunction, (-1, 2), lambda n: (torch.randn(n, 7, dtype=torch.float64),)),
    "log_normal_cdf": (LogNormalCDF, (), lambda n: (torch.randn(n, 5, dtype=torch.float64) * 2,)),
    "spd_solve": (SPDSolve, (), lambda n: (torch.randn(n, n, dtype=torch.float64),
                                           torch.randn(n, 3, dtype=torch.float64))),
}


def _dynamic(case):
    if case == "spd_solve":
        n = Dim("n")
        return ({0: n, 1: n}, {0: n})
    return ({0: Dim("batch")},)


def _stock_values_and_grads(C, consts, xs, g):
    leaves = [x.clone().requires_grad_() for x in xs]
    out = C.apply(*leaves, *consts)
    out.backward(g)
    return out.detach(), [x.grad for x in leaves]


def _check_program(ep, C, consts, make, sizes):
    for n in sizes:
        torch.manual_seed(n)
        xs = make(n)
        want, want_grads = _stock_values_and_grads(C, consts, xs, g := torch.randn_like(C.apply(*xs, *consts)))
        leaves = [x.clone().requires_grad_() for x in xs]
        got = ep.module()(*leaves)
        torch.testing.assert_close(got, want)
        got.backward(g)  # the op's custom backward
        for a, b in zip([x.grad for x in leaves], want_grads):
            torch.testing.assert_close(a, b)


def _fresh(C):
    return type(C.__name__, (C,), {})


# ---- tests ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_wrapped_function_with_data_dependent_python_exports(case, dynamic):
    C, consts, make = CASES[case]
    W = torch_opaque.wrap(_fresh(C))
    torch.manual_seed(0)
    ep = torch.export.export(Call(W, *consts), make(6), dynamic_shapes=(_dynamic(case),) if dynamic else None)
    assert len(op_calls(ep, torch_opaque.lookup(W).name)) == 1
    _check_program(ep, C, consts, make, [6, 9] if dynamic else [6])


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_exports_data_dependent_forward_as_an_op(case):
    C, consts, make = CASES[case]
    C = _fresh(C)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back warning
        with torch_opaque.auto():
            ep = torch.export.export(Call(C, *consts), make(6), dynamic_shapes=(_dynamic(case),))
    assert len(op_calls(ep, torch_opaque.lookup(C).name)) == 1
    _check_program(ep, C, consts, make, [6, 8])


def test_the_fake_is_learnt_without_changing_the_global_rng():
    C, consts, make = CASES["sparsemax"]
    W = torch_opaque.wrap(_fresh(C))
    torch.manual_seed(3)
    x = make(4)
    state = torch.get_rng_state()
    torch.export.export(Call(W, *consts), x)
    assert torch.equal(torch.get_rng_state(), state)


def test_fake_shapes_are_symbolic_where_outputs_follow_input_sizes():
    C, consts, make = CASES["sparsemax"]
    W = torch_opaque.wrap(_fresh(C))
    ep = torch.export.export(Call(W, *consts), make(5), dynamic_shapes=(({0: Dim("batch")},),))
    (node,) = op_calls(ep, torch_opaque.lookup(W).name)
    batch, cols = node.meta["val"].shape
    assert isinstance(batch, torch.SymInt)
    assert str(batch) == str(node.args[0].meta["val"].shape[0])
    assert cols == 7


class Positive(torch.autograd.Function):
    """Output shape depends on the data."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x[x > 0]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        out = torch.zeros_like(x)
        out[x > 0] = g
        return out


def test_data_dependent_output_shape_gets_the_fake_error():
    W = torch_opaque.wrap(_fresh(Positive))
    with pytest.raises(torch_opaque.FakeForwardError) as info:
        torch.export.export(Call(W), (torch.randn(8),))
    msg = str(info.value)
    assert "Positive.forward cannot run on fake tensors while tracing" in msg
    assert "could not be learnt from runs on stand-in data" in msg
    assert "depends on the data" in msg
    assert "add a `fake` staticmethod to Positive" in msg


def test_data_dependent_output_shape_falls_back_under_auto():
    C = _fresh(Positive)
    x = torch.randn(8)
    with warnings.catch_warnings(record=True) as w, torch_opaque.auto():
        warnings.simplefilter("always")
        ep = torch.export.export(Call(C), (x,))
    assert any("Positive" in str(i.message) and "ordinary" in str(i.message) for i in w)
    assert torch_opaque.lookup(C) is None or not op_calls(ep, torch_opaque.lookup(C).name)
    torch.testing.assert_close(ep.module()(x), Positive.apply(x))


def test_a_user_fake_is_never_replaced():
    class WithFake(SparsemaxFunction):
        @staticmethod
        def fake(ctx, X, dim=-1, k=None):
            raise ValueError("the user's fake failed")

    W = torch_opaque.wrap(WithFake)
    with pytest.raises(ValueError, match="the user's fake failed"):
        torch.export.export(Call(W, -1, 2), (torch.randn(3, 7),))


class NeedsPositive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if (x <= 0).any():
            raise ValueError("x must be positive")
        return x.log()

    @staticmethod
    def backward(ctx, g):
        return g


def test_forward_failing_on_stand_in_data_gets_the_fake_error():
    W = torch_opaque.wrap(_fresh(NeedsPositive))
    with pytest.raises(torch_opaque.FakeForwardError) as info:
        torch.export.export(Call(W), (torch.rand(4) + 1,))
    msg = str(info.value)
    assert "it also fails on stand-in data (ValueError: x must be positive)" in msg
    assert "add a `fake` staticmethod to NeedsPositive" in msg


@pytest.mark.parametrize("case", ["sparsemax", "spd_solve"])
def test_compiled_training_step_matches_stock(case):
    C, consts, make = CASES[case]
    W = torch_opaque.wrap(_fresh(C))
    compiled = torch.compile(Call(W, *consts), backend="aot_eager")
    torch.manual_seed(1)
    xs = make(5)
    g = torch.randn_like(C.apply(*xs, *consts))
    want, want_grads = _stock_values_and_grads(C, consts, xs, g)
    leaves = [x.clone().requires_grad_() for x in xs]
    got = compiled(*leaves)
    got.backward(g)
    torch.testing.assert_close(got.detach(), want)
    for a, b in zip([x.grad for x in leaves], want_grads):
        torch.testing.assert_close(a, b)


def test_residual_of_data_dependent_size_under_compile_gets_the_fake_error():
    # LogNormalCDF keeps ctx.numerator / ctx.denominator of the masked entries:
    # torch.compile's shape environment does not allow such sizes by default.
    W = torch_opaque.wrap(_fresh(LogNormalCDF))
    x = (torch.randn(5, 5, dtype=torch.float64) * 2).requires_grad_()
    with pytest.raises(Exception) as info:
        torch.compile(Call(W), backend="aot_eager")(x).sum().backward()
    msg = str(info.value)
    assert "LogNormalCDF.forward cannot run on fake tensors while tracing" in msg
    assert "a tensor it saves for backward has a size that depends on the data" in msg
    assert "capture_dynamic_output_shape_ops" in msg
    assert "add a `fake` staticmethod to LogNormalCDF" in msg


def test_residual_of_data_dependent_size_under_compile_falls_back_under_auto():
    C = _fresh(LogNormalCDF)
    x = torch.randn(5, 5, dtype=torch.float64) * 2
    g = torch.randn(5, 5, dtype=torch.float64)
    want, (want_grad,) = _stock_values_and_grads(C, (), (x,), g)
    leaf = x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as w, torch_opaque.auto():
        warnings.simplefilter("always")
        got = torch.compile(Call(C), backend="aot_eager")(leaf)
        got.backward(g)
    assert any("LogNormalCDF" in str(i.message) and "ordinary" in str(i.message) for i in w)
    torch.testing.assert_close(got.detach(), want)
    torch.testing.assert_close(leaf.grad, want_grad)
