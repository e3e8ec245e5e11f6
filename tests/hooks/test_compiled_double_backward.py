"""Double backward through torch.compile'd code calling wrapped Functions
(Note [Double backward in compiled graphs]), against the same Functions
unwrapped in eager mode; aot_eager and Inductor."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import torch_opaque
from opaque_fixtures.archops import Cube, MulAdd, ScaledSin
from support.processes import run_python
from torch_opaque._impl.function import _ORIGINAL_APPLY

BACKENDS = ["aot_eager", "inductor"]
NO_DOUBLE = "torch.compile with aot_autograd does not currently support double backward"


def original(cls, *args):
    return _ORIGINAL_APPLY(cls, *args)


@torch_opaque.op(name="DblTanh")
class Tanh(torch.autograd.Function):
    """Saves its output: the second derivative goes through the op's own node."""

    forwards = 0

    @staticmethod
    def forward(ctx, x):
        Tanh.forwards += 1
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


@torch_opaque.op(name="DblOnceSquare")
class OnceSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class StockTanh(torch.autograd.Function):
    """Never wrapped: Dynamo inlines it, torch's own compiled backward runs."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dbl(*shape):
    return torch.randn(*shape, dtype=torch.double, requires_grad=True)


def mixed(apply_tanh, apply_sin, apply_cube):
    """ATen ops around three Functions: saved outputs, ctx attributes, a custom backward."""

    def f(x, w):
        h = apply_tanh(x * w) + x.exp() * 0.1
        return apply_sin(h, 1.5).sum() + apply_cube(h).pow(2).sum() + (h * w).sum()

    return f


OURS = mixed(Tanh.apply, ScaledSin.apply, Cube.apply)
STOCK = mixed(
    lambda t: original(Tanh, t),
    lambda t, s: original(ScaledSin, t, s),
    lambda t: original(Cube, t),
)


def second_order(fn, x, w, v):
    gx, gw = torch.autograd.grad(fn(x, w), (x, w), create_graph=True)
    return (gx, gw) + torch.autograd.grad((gx * v).sum() + gw.pow(2).sum(), (x, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_derivatives_equal_stock_eager(backend):
    x, w, v = dbl(5), dbl(5), torch.randn(5, dtype=torch.double)
    ours = second_order(torch.compile(OURS, backend=backend, fullgraph=True), x, w, v)
    ref = second_order(STOCK, x, w, v)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradgradcheck(backend):
    # Functions whose backwards are exact derivatives (Cube's is not, by design)
    def exact(x, w):
        h = Tanh.apply(x * w) + x.exp() * 0.1
        return ScaledSin.apply(h, 1.5) * w

    f = torch.compile(exact, backend=backend, fullgraph=True)
    assert torch.autograd.gradgradcheck(f, (dbl(4), dbl(4)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hessian_equals_stock(backend):
    x, w = torch.randn(4, dtype=torch.double), torch.randn(4, dtype=torch.double)
    f = torch.compile(OURS, backend=backend, fullgraph=True)
    torch.testing.assert_close(
        torch.autograd.functional.hessian(f, (x, w)),
        torch.autograd.functional.hessian(STOCK, (x, w)),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_hessian_vector_product_with_differentiable_vector(backend):
    # The incoming gradient requires grad: the replay's gradients are
    # differentiable with respect to it too.
    x, w = dbl(5), dbl(5)

    def hvp_then_grad_v(fn):
        v = torch.randn(5, dtype=torch.double, generator=torch.Generator().manual_seed(1))
        v.requires_grad_(True)
        y = fn(x, w)
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        (hv,) = torch.autograd.grad(gx, x, v, create_graph=True)
        return (hv,) + torch.autograd.grad(hv.pow(2).sum(), (x, w, v))

    f = torch.compile(OURS, backend=backend, fullgraph=True)
    for a, b in zip(hvp_then_grad_v(f), hvp_then_grad_v(STOCK)):
        torch.testing.assert_close(a, b)


class PenaltyModel(torch.nn.Module):
    def __init__(self, tanh):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4).double()
        self.out = torch.nn.Linear(4, 1).double()
        self.tanh = tanh

    def forward(self, x):
        return self.out(self.tanh(self.lin(x)))


def penalty_grads(model, x):
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    loss = y.pow(2).mean() + (gx.norm(dim=1) - 1).pow(2).mean()
    loss.backward()
    return [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_penalty_of_a_compiled_module_equals_stock(backend):
    x = torch.randn(6, 4, dtype=torch.double)
    ours = penalty_grads(
        torch.compile(PenaltyModel(Tanh.apply), backend=backend), x.clone().requires_grad_()
    )
    ref = penalty_grads(PenaltyModel(lambda t: original(Tanh, t)), x.clone().requires_grad_())
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_outputs_and_a_residual(backend):
    a, b = dbl(2, 3), dbl(2, 3)

    def second(fn):
        s, t = fn(a, b)
        ga, gb = torch.autograd.grad((s * t).sum(), (a, b), create_graph=True)
        return torch.autograd.grad((ga * ga).sum() + gb.sum(), (a, b))

    compiled = torch.compile(lambda p, q: MulAdd.apply(p.sin(), q), backend=backend, fullgraph=True)
    stock = lambda p, q: original(MulAdd, p.sin(), q)  # noqa: E731
    for ours, ref in zip(second(compiled), second(stock)):
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_across_a_graph_break(backend):
    def f(x):
        h = Tanh.apply(x * 2)
        torch._dynamo.graph_break()
        return Cube.apply(h + 1).sum()

    def r(x):
        return original(Cube, original(Tanh, x * 2) + 1).sum()

    x, v = dbl(4), torch.randn(4, dtype=torch.double)
    ours = torch.autograd.grad(torch.compile(f, backend=backend)(x), x, create_graph=True)[0]
    ref = torch.autograd.grad(r(x), x, create_graph=True)[0]
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(
        torch.autograd.grad(ours, x, v)[0], torch.autograd.grad(ref, x, v)[0]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_shapes(backend):
    f = torch.compile(OURS, backend=backend, dynamic=True, fullgraph=True)
    for n in (3, 5):
        x, w, v = dbl(n), dbl(n), torch.randn(n, dtype=torch.double)
        for a, b in zip(second_order(f, x, w, v), second_order(STOCK, x, w, v)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_order_backward_runs_the_compiled_backward_only(backend):
    f = torch.compile(lambda x: Tanh.apply(x).sum(), backend=backend, fullgraph=True)
    x = dbl(3)
    f(x)  # compile
    # The class counter is state outside the call (Note [Forward side effects]):
    # Inductor keeps the op's call opaque, so the forward counts once per call
    # under every backend, as stock's compiled code replays the count (Note
    # [Inductor sees through opaque ops] in torch_opaque/integrations/inductor.py)
    per_call = 1
    Tanh.forwards = 0
    (g,) = torch.autograd.grad(f(x), x)
    assert Tanh.forwards == per_call and not g.requires_grad
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    assert Tanh.forwards == 2 * per_call + 1  # the forward, then its eager replay
    assert g.grad_fn is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_released_by_a_backward_that_frees_the_graph(backend):
    f = torch.compile(lambda x: Tanh.apply(x * 2), backend=backend, fullgraph=True)
    y = f(dbl(3))
    node = y.grad_fn
    assert node._torch_opaque_replay is not None
    y.sum().backward(retain_graph=True)
    assert node._torch_opaque_replay is not None
    y.sum().backward()
    assert node._torch_opaque_replay is None


def once_error(fn, grad_out_requires_grad):
    x = dbl(3)
    v = torch.ones(3, dtype=torch.double, requires_grad=grad_out_requires_grad)
    (g,) = torch.autograd.grad(fn(x), x, v, create_graph=True)
    torch.testing.assert_close(g, 2 * x.detach())
    with pytest.raises(RuntimeError) as info:
        g.sum().backward()
    return str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_out_requires_grad", [False, True])
def test_once_differentiable_gives_torchs_eager_error(backend, grad_out_requires_grad):
    compiled = torch.compile(OnceSquare.apply, backend=backend, fullgraph=True)
    ours = once_error(compiled, grad_out_requires_grad)
    assert ours == once_error(lambda t: original(OnceSquare, t), grad_out_requires_grad)
    if grad_out_requires_grad:
        assert "marked with @once_differentiable" in ours


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_without_opaque_ops_keep_torchs_error(backend):
    for fn in (StockTanh.apply, lambda t: t.tanh() * t):
        torch._dynamo.reset()
        x = dbl(3)
        (g,) = torch.autograd.grad(
            torch.compile(fn, backend=backend, fullgraph=True)(x).sum(), x, create_graph=True
        )
        with pytest.raises(RuntimeError, match=NO_DOUBLE):
            g.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_forward_keeps_torchs_error(backend):
    # Dropout's mask would be drawn again by a replay: torch's compiled
    # backward runs instead, and differentiating it again is torch's error.
    def f(x):
        return Tanh.apply(F.dropout(x, 0.5, training=True)).sum()

    x = dbl(64)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    # first order is right: dropped elements get 0, kept ones 2 (1 - tanh(2x)^2)
    kept = g != 0
    assert 0 < kept.sum() < 64
    t = torch.tanh(2 * x.detach()[kept])
    torch.testing.assert_close(g[kept], 2 * (1 - t * t))
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_mutation_keeps_torchs_error(backend):
    def f(x, buf):
        buf.add_(1)
        return Tanh.apply(x * buf).sum()

    x, buf = dbl(3), torch.ones(3, dtype=torch.double)
    (g,) = torch.autograd.grad(
        torch.compile(f, backend=backend, fullgraph=True)(x, buf), x, create_graph=True
    )
    torch.testing.assert_close(g, 2 * (1 - torch.tanh(2 * x.detach()) ** 2))
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_installed_when_compile_first_runs_not_on_import(backend):
    # A fresh process whose first torch.compile imports Dynamo (and Inductor):
    # the hook arms itself then, not on import or wrap.
    out = run_python(
        f"""
        import sys, torch, torch_opaque
        from opaque_fixtures.archops import ScaledSin
        ScaledSin.apply(torch.ones(2), 1.0)
        assert "torch._dynamo" not in sys.modules, "wrapping imported torch._dynamo"
        f = torch.compile(lambda x: ScaledSin.apply(x * 2, 1.5).sum(), backend="{backend}")
        x = torch.randn(3, dtype=torch.double, requires_grad=True)
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(h, -6 * (2 * x.detach()).sin())
        """,
        with_fixtures=True,
    )
    assert out.returncode == 0, out.stderr
    assert "not installed" not in out.stderr


@pytest.mark.usefixtures("example_ops")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cpp_op_backward_written_with_aten_ops(backend):
    # example::scaled_sin (examples/cpp): a C++ op, its backward made of ATen ops.
    def f(x):
        return torch.ops.example.scaled_sin(x * x, 1.5).sum()

    x, v = dbl(3, 4), torch.randn(3, 4, dtype=torch.double)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    (h,) = torch.autograd.grad(g, x, v)
    t = x.detach()
    torch.testing.assert_close(g, 1.5 * (t * t).cos() * 2 * t)
    torch.testing.assert_close(h, v * 1.5 * (2 * (t * t).cos() - 4 * t * t * (t * t).sin()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_that_are_views_of_intermediates(backend):
    # AOTAutograd returns the views' base from its Function and regenerates
    # the views outside it: the replay returns that base too.
    def f(x):
        y = Tanh.apply(x * 2)
        return y.view(-1), y.t(), Cube.apply(x)[0]

    def r(x):
        y = original(Tanh, x * 2)
        return y.view(-1), y.t(), original(Cube, x)[0]

    def second(fn):
        x = torch.linspace(-1, 1, 6, dtype=torch.double).reshape(2, 3).requires_grad_()
        a, b, c = fn(x)
        (g,) = torch.autograd.grad(a.sum() + (b * b).sum() + c.sum(), x, create_graph=True)
        return (g,) + torch.autograd.grad(g.pow(2).sum(), x)

    for ours, ref in zip(second(torch.compile(f, backend=backend, fullgraph=True)), second(r)):
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_that_are_inputs_or_their_views(backend):
    def f(x, w):
        return Tanh.apply(x * w).sum(), x.view(-1), w

    def second(fn):
        x, w = dbl(2, 3), dbl(2, 3)
        with torch.no_grad():
            x.copy_(torch.linspace(-1, 1, 6).reshape(2, 3))
            w.fill_(0.7)
        s, xv, same_w = fn(x, w)
        gx, gw = torch.autograd.grad(s + (xv * xv).sum() + same_w.sum(), (x, w), create_graph=True)
        return (gx, gw) + torch.autograd.grad((gx * gw).sum(), (x, w))

    def r(x, w):
        return original(Tanh, x * w).sum(), x.view(-1), w

    for ours, ref in zip(second(torch.compile(f, backend=backend, fullgraph=True)), second(r)):
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_with_an_inlined_stock_function_keeps_torchs_error(backend):
    # Dynamo inlines StockTanh as a higher-order op whose eager replay would
    # not differentiate its backward: no replay, torch's error.
    def f(x):
        return StockTanh.apply(Tanh.apply(x * 2) * 3).sum()

    x = dbl(4)
    (g,) = torch.autograd.grad(torch.compile(f, backend=backend, fullgraph=True)(x), x, create_graph=True)
    (ref,) = torch.autograd.grad(StockTanh.apply(original(Tanh, x * 2) * 3).sum(), x)
    torch.testing.assert_close(g, ref)
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()


SCALE = [1.0]


@torch_opaque.op(name="DblGlobalScale")
class GlobalScale(torch.autograd.Function):
    """Reads global state when it runs: a replay after the state changed
    would compute something else."""

    @staticmethod
    def forward(ctx, x):
        ctx.scale = SCALE[0]
        ctx.save_for_backward(x)
        return x.sin() * ctx.scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_that_differs_from_the_forward_keeps_torchs_error(backend):
    f = torch.compile(lambda x: GlobalScale.apply(x * 2).sum(), backend=backend, fullgraph=True)
    x = dbl(3)
    SCALE[0] = 1.0
    try:
        y = f(x)
        SCALE[0] = 3.0  # the replay would compute 3 sin(2x)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
    finally:
        SCALE[0] = 1.0
    torch.testing.assert_close(g, 2 * (2 * x.detach()).cos())
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()
    # unchanged state: the replay is used
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(h, -4 * (2 * x.detach()).sin())


class WideModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(256, 256)
        self.out = torch.nn.Linear(256, 1)

    def forward(self, x):
        return self.out(Tanh.apply(self.lin(x)) + ScaledSin.apply(x, 0.5)).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_gradient_penalty_of_a_wider_model(backend):
    # float32 and sums over many elements: the compiled forward rounds
    # differently from the replay, which must still be accepted.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    model = WideModel()
    ref_model = WideModel()
    ref_model.forward = lambda t: ref_model.out(  # the stock Functions, eagerly
        original(Tanh, ref_model.lin(t)) + original(ScaledSin, t, 0.5)
    ).sum()

    def penalty(m):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(m(xi), xi, create_graph=True)
        gx.pow(2).sum().backward()
        return [p.grad for p in (m.lin.weight, m.lin.bias, m.out.weight)]

    for a, b in zip(penalty(torch.compile(model, backend=backend)), penalty(ref_model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@torch_opaque.op(name="DblNoisyScale")
class NoisyScale(torch.autograd.Function):
    """Samples inside the Function: a replay would draw other numbers."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x) + 0.5
        ctx.save_for_backward(x, noise)
        return x.sin() * noise

    @staticmethod
    def backward(ctx, g):
        x, noise = ctx.saved_tensors
        return g * x.cos() * noise


@pytest.mark.parametrize("backend", BACKENDS)
def test_function_that_samples_keeps_torchs_error(backend):
    x = dbl(5)
    f = torch.compile(lambda t: NoisyScale.apply(t * 2).sum(), backend=backend, fullgraph=True)
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    noise = g / (2 * (2 * x.detach()).cos())
    assert ((noise >= 0.5) & (noise <= 1.5)).all()
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_keeps_torchs_error(backend):
    x = torch.randn(4, requires_grad=True)
    f = torch.compile(lambda t: Tanh.apply(t @ t.view(4, 1)).sum(), backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        g.sum().backward()
