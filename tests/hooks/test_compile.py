"""Acceptance 4 and 5: torch.compile and torch.func keep the custom backward."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

import torch_opaque
from conftest import aten_calls, op_calls


@torch_opaque.op(name="CSin")
class CSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.scale = 1.0
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos() * ctx.scale


@torch_opaque.op(name="Straight")
class StraightThrough(torch.autograd.Function):
    """Round forward, identity backward: the custom backward is observable."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class RecordingBackend:
    def __init__(self):
        self.fw, self.bw = [], []

    def __call__(self, gm, inputs):
        def fw(g, _):
            self.fw.append(g)
            return make_boxed_func(g)

        def bw(g, _):
            self.bw.append(g)
            return make_boxed_func(g)

        return aot_module_simplified(gm, inputs, fw_compiler=fw, bw_compiler=bw)


def test_compile_graphs_hold_opaque_forward_and_backward():
    backend = RecordingBackend()
    f = torch.compile(lambda x: CSin.apply(x) * 2, backend=backend, fullgraph=True)
    x = torch.randn(5, requires_grad=True)
    y = f(x)
    y.sum().backward()
    torch.testing.assert_close(y, x.detach().sin() * 2)
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    (fw,), (bw,) = backend.fw, backend.bw
    assert [n.target for n in op_calls(fw, "CSin")] == [torch.ops.opaque.CSin_fwd.Tensor]
    assert [n.target for n in op_calls(bw, "CSin")] == [torch.ops.opaque.CSin_bwd.Tensor]
    assert not aten_calls(fw, "sin") and not aten_calls(bw, "cos")
    # non-tensor ctx state travels as a schema argument of the backward op
    (bwd_node,) = op_calls(bw, "CSin")
    assert "scale" in bwd_node.args[3]


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_matches_eager(dynamic):
    f = torch.compile(lambda x: CSin.apply(x).exp(), fullgraph=True, dynamic=dynamic)
    for n in (3, 6):
        x = torch.randn(n, requires_grad=True)
        y = f(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(y, x.detach().sin().exp())
        torch.testing.assert_close(g, x.detach().sin().exp() * x.detach().cos())


def test_inference_compile_has_single_op_node():
    backend = RecordingBackend()
    f = torch.compile(lambda x: CSin.apply(x), backend=backend, fullgraph=True)
    with torch.no_grad():
        f(torch.randn(3))
    (fw,) = backend.fw
    assert [n.target for n in op_calls(fw, "CSin")] == [torch.ops.opaque.CSin.Tensor]


@torch_opaque.op(name="F1")
class F1(torch.autograd.Function):
    """pytorch/pytorch#183604: the same tensor passed twice."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b + a + b

    @staticmethod
    def backward(ctx, go):
        a, b = ctx.saved_tensors
        return go * (b + 1), go * (a + 1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_same_tensor_twice_under_compile(backend):
    def fn(x):
        return F1.apply(x, x).sum()

    x = torch.tensor([0.7, -1.3, 2.1, 0.05, -0.5], requires_grad=True)
    fn(x).backward()
    eager = x.grad.clone()
    torch.testing.assert_close(eager, 2 * (x.detach() + 1))
    x.grad = None
    torch.compile(fn, backend=backend, fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager)


@torch_opaque.op(name="ZeroBack")
class SinWithZeroBackward(torch.autograd.Function):
    """pytorch/pytorch#193279: the custom backward must survive func.grad + compile."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def test_func_grad_keeps_custom_backward_under_compile():
    def loss(x):
        return SinWithZeroBackward.apply(x).sum()

    x = torch.randn(4)
    eager = torch.func.grad(loss)(x)
    torch.testing.assert_close(eager, torch.zeros(4))
    compiled = torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, torch.zeros(4))


def test_func_grad_and_vjp():
    x = torch.randn(4, dtype=torch.double)
    g = torch.func.grad(lambda t: CSin.apply(t).sum())(x)
    torch.testing.assert_close(g, x.cos())
    out, vjp_fn = torch.func.vjp(CSin.apply, x)
    torch.testing.assert_close(out, x.sin())
    (v,) = vjp_fn(torch.full((4,), 3.0, dtype=torch.double))
    torch.testing.assert_close(v, 3 * x.cos())
    # straight-through estimator: gradient is the custom identity, not round's zero
    torch.testing.assert_close(
        torch.func.grad(lambda t: StraightThrough.apply(t).sum())(x), torch.ones(4, dtype=torch.double)
    )
    # the forward-style (ctx) Function also works under torch.func, unlike upstream
    torch.testing.assert_close(
        torch.func.grad(lambda t: F1.apply(t, t).sum())(x), 2 * (x + 1)
    )


def test_func_vmap_runs_per_sample():
    x = torch.randn(3, 4)
    torch.testing.assert_close(torch.func.vmap(CSin.apply)(x), x.sin())


@torch_opaque.op(name="TanhResidual")
class TanhResidual(torch.autograd.Function):
    """Saves an intermediate (a residual of `_fwd`) only when x needs a gradient."""

    @staticmethod
    def forward(ctx, x, y):
        t = x.tanh()
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(t)
        return t * y

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return g * (1 - t * t) * 3, None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_returns_the_residuals_it_was_traced_with(backend):
    # The compiled forward graph calls `_fwd` directly (no Autograd kernel); the
    # traced needs_input_grad argument makes it save the same residuals.
    backend_fn = RecordingBackend() if backend == "aot_eager" else backend
    f = torch.compile(lambda x, y: TanhResidual.apply(x, y), backend=backend_fn, fullgraph=True)
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5)
    out = f(x, y)
    out.sum().backward()
    torch.testing.assert_close(out, x.detach().tanh() * y)
    torch.testing.assert_close(x.grad, (1 - x.detach().tanh() ** 2) * 3)
    if backend == "aot_eager":
        (node,) = op_calls(backend_fn.fw[0], "TanhResidual")
        assert node.args[-1] == [True, False]
