"""Wrapped Functions and small models used by the archive, pass and CLI tests.

The op names are explicit (``Arch*``) so archives name them the same way in
every process. Running this module prints nothing and defines no op until a
Function is called (overloads are defined on first use).
"""

import torch

import torch_opaque


@torch_opaque.op(name="ArchScaledSin")
class ScaledSin(torch.autograd.Function):
    """y = sin(x) * scale; the backward is deliberately the exact derivative."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.sin() * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.scale, None


@torch_opaque.op(name="ArchMulAdd")
class MulAdd(torch.autograd.Function):
    """Two outputs, a residual (an intermediate), symbolic-size state."""

    @staticmethod
    def forward(ctx, a, b):
        prod = a * b
        ctx.save_for_backward(a, b, prod.tanh())
        ctx.rows = a.shape[0]
        return prod + a, prod.tanh()

    @staticmethod
    def backward(ctx, g_sum, g_tanh):
        a, b, t = ctx.saved_tensors
        assert ctx.rows == a.shape[0]
        g_prod = g_sum + g_tanh * (1 - t * t)
        return g_prod * b + g_sum, g_prod * a


@torch_opaque.op(name="ArchCube")
class Cube(torch.autograd.Function):
    """A custom backward that differs from autograd's (scaled by 0.5), so a test
    can tell the stored backward ran."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 0.5 * 3 * x * x * g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = ScaledSin.apply(self.a(x), 1.5)
        s, t = MulAdd.apply(h, h + 1)
        return self.b(s + t) + Cube.apply(x[:, :4])


class Small(torch.nn.Module):
    def forward(self, x):
        return ScaledSin.apply(x, 2.0) + Cube.apply(x)


def example_input(batch: int = 5) -> torch.Tensor:
    torch.manual_seed(batch)
    return torch.randn(batch, 6)


def export_net(dynamic: bool = True):
    x = example_input()
    dyn = ({0: torch.export.Dim("batch", min=2)},) if dynamic else None
    return torch.export.export(Net(), (x,), dynamic_shapes=dyn)


@torch_opaque.op(name="ArchCubeAlt")
class CubeAlt(torch.autograd.Function):
    """The same forward as Cube under another op name (a replacement target)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


@torch_opaque.op(name="ArchOuter")
class Outer(torch.autograd.Function):
    """A forward that calls another opaque op (nested ops in stored programs)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return Cube.apply(x) + x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (3 * x * x + 1)


class NestedNet(torch.nn.Module):
    def forward(self, x):
        return Outer.apply(x).sum(dim=-1)


def export_nested():
    return torch.export.export(
        NestedNet(), (example_input(),), dynamic_shapes=({0: torch.export.Dim("batch")},)
    )


@torch_opaque.op(name="ArchAddInPlace")
class AddInPlace(torch.autograd.Function):
    """x += y in place (ctx.mark_dirty) with two tensor arguments, so an
    archive can claim the other one is modified (tests/archive/test_archive_owned_ops.py)."""

    @staticmethod
    def forward(ctx, x, y):
        x.add_(y)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, g


@torch_opaque.op(name="ArchHalf")
class Half(torch.autograd.Function):
    """Its return is annotated, its argument not: the output structure is known
    without a call, but the op is defined by the first call (or a load)."""

    @staticmethod
    def forward(ctx, x) -> torch.Tensor:
        return x * 0.5

    @staticmethod
    def backward(ctx, g):
        return g * 0.5
