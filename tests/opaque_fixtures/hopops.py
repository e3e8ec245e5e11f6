"""Functions whose forward or backward torch.export traces into higher-order
ops (grad-mode regions, autocast, cond, while_loop, map, nested opaque ops),
written the way packages write them; used by tests/archive/test_archive_hops.py.

Every backward is deliberately not autograd's derivative of the forward (a
factor, a straight-through estimate), so a test can tell the custom backward
ran. ``CASES`` maps a case name to (module factory, example inputs); every
tensor input of a case gets a gradient.
"""

import torch

import torch_opaque
from torch._higher_order_ops.map import map as hop_map


@torch_opaque.op(name="HopSpike")
class Spike(torch.autograd.Function):
    """A spiking neuron: fires where the membrane passes the threshold (computed
    under torch.no_grad()); surrogate gradient (a sigmoid's) in backward."""

    @staticmethod
    def forward(ctx, v):
        with torch.no_grad():
            spikes = (v > 0.5).to(v.dtype)
        ctx.save_for_backward(v)
        return spikes

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        s = torch.sigmoid(4 * (v - 0.5))
        return g * 4 * s * (1 - s)


@torch_opaque.op(name="HopSortTop")
class SortTop(torch.autograd.Function):
    """A sort helper (as in a transformers model): the order is found under
    ``set_grad_enabled(False)``; the gradient flows back through the order."""

    @staticmethod
    def forward(ctx, x):
        with torch.set_grad_enabled(False):
            order = x.argsort(dim=-1, descending=True)
        ctx.save_for_backward(order)
        return x.gather(-1, order) * 2

    @staticmethod
    def backward(ctx, g):
        (order,) = ctx.saved_tensors
        return torch.zeros_like(g).scatter(-1, order, g) * 0.5


@torch_opaque.op(name="HopBackNoGrad")
class BackNoGrad(torch.autograd.Function):
    """A backward that computes its gradient under torch.no_grad() and
    set_grad_enabled(False)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.no_grad():
            gx = g * w * 0.5
        with torch.set_grad_enabled(False):
            gw = (g * x).sum(0) * 0.5
        return gx, gw


@torch_opaque.op(name="HopEnableGrad")
class EnableGradRegion(torch.autograd.Function):
    """A forward with an enable_grad() block (eager runs forward with grad mode
    off) and a backward with a no_grad() block."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            y = x.tanh()
        ctx.save_for_backward(x)
        return y.detach() * 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return g * (1 - x.tanh() ** 2)


@torch_opaque.op(name="HopAutocast")
class AutocastMatmul(torch.autograd.Function):
    """A matmul under CPU autocast (bfloat16), the rest in float32; an autocast
    block with a no_grad() block inside (which torch.export splits into an
    empty autocast region and the real one)."""

    @staticmethod
    def forward(ctx, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                z = (x @ w).relu()
        ctx.save_for_backward(x, w)
        return y.float() + z.float()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            return g @ w.t(), x.t() @ g


@torch_opaque.op(name="HopCond")
class CondSign(torch.autograd.Function):
    """torch.cond on the data in forward and in backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos() * 2, (x,))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.cond(x.sum() > 0, lambda t, u: u * t.cos(), lambda t, u: -u * t.sin(), (x, g))


@torch_opaque.op(name="HopWhile")
class HalveUntilSmall(torch.autograd.Function):
    """while_loop: halves x until its largest magnitude is below 1 (a data-dependent
    number of steps), counting the steps in a tensor."""

    @staticmethod
    def forward(ctx, x):
        steps, y = torch._higher_order_ops.while_loop(
            lambda n, t: t.abs().max() >= 1,
            lambda n, t: (n + 1, t / 2),
            (torch.zeros((), dtype=torch.int64), x.clone()),
        )
        ctx.save_for_backward(steps)
        return y

    @staticmethod
    def backward(ctx, g):
        (steps,) = ctx.saved_tensors
        return g * torch.pow(0.5, steps.to(g.dtype))


@torch_opaque.op(name="HopMap")
class RowScale(torch.autograd.Function):
    """map over the rows of x, with an extra argument."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return hop_map(lambda row, w: (row * w).sin(), x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        c = hop_map(lambda row, w: (row * w).cos(), x, w)
        return g * c * w, (g * c * x).sum(0)


@torch_opaque.op(name="HopOuter")
class OuterNoGrad(torch.autograd.Function):
    """Calls other opaque ops inside its regions: Spike under no_grad(), SortTop
    in a cond branch."""

    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            s = Spike.apply(x)
        y = torch.cond(x.sum() > 0, lambda t: SortTop.apply(t), lambda t: t * 2, (x,))
        ctx.save_for_backward(x)
        return y + s

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return g * 0.25 + Spike.apply(x) * 0


class Apply(torch.nn.Module):
    def __init__(self, fn, n_in: int):
        super().__init__()
        self.fn, self.n_in = fn, n_in

    def forward(self, *xs):
        return self.fn.apply(*xs)


class TopLevelRegions(torch.nn.Module):
    """Regions in the exported module itself, around opaque calls."""

    def forward(self, x):
        with torch.set_grad_enabled(False):
            s = Spike.apply(x)
        y = torch.cond(x.sum() > 0, lambda t: SortTop.apply(t), lambda t: t * 3, (x,))
        return y + s + BackNoGrad.apply(x, x[0])


def _x(*shape, seed=0, positive=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    if positive is True:
        t = t.abs() + 0.1
    elif positive is False:
        t = -t.abs() - 0.1
    return t


CASES = {
    "spike_no_grad": (lambda: Apply(Spike, 1), (_x(4, 5),)),
    "sort_set_grad_false": (lambda: Apply(SortTop, 1), (_x(4, 5, seed=1),)),
    "backward_no_grad": (lambda: Apply(BackNoGrad, 2), (_x(4, 5, seed=2), _x(5, seed=3))),
    "enable_grad_in_forward": (lambda: Apply(EnableGradRegion, 1), (_x(4, 5, seed=4),)),
    "autocast": (lambda: Apply(AutocastMatmul, 2), (_x(4, 8, seed=5), _x(8, 3, seed=6))),
    "cond_true": (lambda: Apply(CondSign, 1), (_x(4, 5, positive=True),)),
    "cond_false": (lambda: Apply(CondSign, 1), (_x(4, 5, positive=False),)),
    "while_loop": (lambda: Apply(HalveUntilSmall, 1), (_x(4, 5, seed=7) * 9,)),
    "map": (lambda: Apply(RowScale, 2), (_x(4, 5, seed=8), _x(5, seed=9))),
    "nested_opaque": (lambda: Apply(OuterNoGrad, 1), (_x(4, 5, positive=True),)),
    "top_level_regions": (lambda: TopLevelRegions(), (_x(4, 5, positive=True),)),
}
