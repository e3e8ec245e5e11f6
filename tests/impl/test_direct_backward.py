"""Note [Direct backward] (include/torch_opaque/opaque_op.h): in plain eager mode the
backward node calls the op's backward kernel without the dispatcher; wherever
`Name_bwd` could be observed (profiler, dispatch modes, meta tensors with a fake,
create_graph) it is still called through the dispatcher. Each case compares with the
unwrapped Function."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_opaque
from torch_opaque._impl.function import _ORIGINAL_APPLY


class DirectScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (ctx.scale - y * y / ctx.scale), None


Wrapped = torch_opaque.wrap(DirectScaledTanh, name="DirectScaledTanh")


def reference_grad(x, g, scale=0.5):
    x = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(_ORIGINAL_APPLY(DirectScaledTanh, x, scale), x, g)
    return dx


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def bwd_name():
    """"ns::Name_bwd" of Wrapped's one overload."""
    (ov,) = torch_opaque.lookup(Wrapped).overloads.values()
    return ov.bwd_op._schema.name


def test_eager_backward_matches_stock_and_runs_twice_with_retain_graph():
    x = torch.randn(16, requires_grad=True)
    g = torch.randn(16)
    y = Wrapped.apply(x, 0.5)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    torch.testing.assert_close(dx, reference_grad(x, g))
    (dx2,) = torch.autograd.grad(y, x, g)  # the node runs its backward again
    torch.testing.assert_close(dx2, dx)
    with pytest.raises(RuntimeError, match="a second time"):
        torch.autograd.grad(y, x, g)


def test_profiler_sees_the_backward_op():
    x = torch.randn(16, requires_grad=True)
    g = torch.randn(16)
    y = Wrapped.apply(x, 0.5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (dx,) = torch.autograd.grad(y, x, g)
    names = {e.name for e in prof.events()}
    assert bwd_name() in names, names
    torch.testing.assert_close(dx, reference_grad(x, g))


def test_dispatch_mode_active_during_backward_sees_the_backward_op():
    x = torch.randn(16, requires_grad=True)
    g = torch.randn(16)
    y = Wrapped.apply(x, 0.5)
    mode = RecordOps()
    with mode:
        (dx,) = torch.autograd.grad(y, x, g)
    assert any(n.startswith(bwd_name().replace("::", ".")) for n in mode.names), mode.names
    torch.testing.assert_close(dx, reference_grad(x, g))


def test_create_graph_still_differentiates_the_backward():
    x = torch.randn(8, requires_grad=True, dtype=torch.double)
    g = torch.randn(8, dtype=torch.double)
    (dx,) = torch.autograd.grad(Wrapped.apply(x, 0.5), x, g, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.sum(), x)
    xr = x.detach().requires_grad_()
    (ref,) = torch.autograd.grad(_ORIGINAL_APPLY(DirectScaledTanh, xr, 0.5), xr, g, create_graph=True)
    (ref2,) = torch.autograd.grad(ref.sum(), xr)
    torch.testing.assert_close(ddx, ref2)


def test_backward_error_is_the_users_error():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise ValueError("bad backward 7")

    W = torch_opaque.wrap(Bad, name="DirectBad")
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="bad backward 7"):
        W.apply(x).sum().backward()
