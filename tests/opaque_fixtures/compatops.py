"""Functions of the archives kept in tests/fixtures (make_archives_v2.py).

Those archives name this module, its classes and their op names: none of them
may be renamed or changed (the fixtures would then test something else). Their
forwards and backwards compute sizes that are expressions of the input's, so
that the programs stored in self-contained archives hold size expressions,
not only bare symbols. Nothing here runs on import but the decorators.
"""

import torch

import torch_opaque
from opaque_fixtures import archops


@torch_opaque.op(name="CompatPairs")
class Pairs(torch.autograd.Function):
    """For x of shape [n, 6]: x as 2n rows of 3, then those rows but the first,
    doubled: [4n - 1, 3]. The backward reads the sizes from the gradient alone
    ((m + 1) // 2 of its m rows are the first part) and deliberately takes the
    doubled rows' gradient 3 times, not 2, so a test can tell it ran."""

    @staticmethod
    def forward(ctx, x):
        h = x.reshape(-1, 3)
        return torch.cat([h, h[1:] * 2])

    @staticmethod
    def backward(ctx, gy):
        half = (gy.shape[0] + 1) // 2
        gh = gy[:half] + torch.cat([torch.zeros_like(gy[:1]), 3 * gy[half:]])
        return gh.reshape(-1, 6)


@torch_opaque.op(name="CompatFold")
class Fold(torch.autograd.Function):
    """Two outputs for x of shape [n, 6]: ``y`` as Pairs' ([4n - 1, 3]) and
    ``e`` [(n + 1) // 2], the sums of the even rows. The row count n is ctx
    state (a symbolic int in a program), which the backward uses with the
    gradients' sizes: its stored program relates them (4*rows - 1). The
    backward is exact for ``y`` and deliberately a quarter of the derivative
    for ``e``."""

    @staticmethod
    def forward(ctx, x):
        h = x.reshape(-1, 3)
        y = torch.cat([h, h[1:] * 2])
        e = x[::2].sum(dim=1)
        ctx.rows = x.shape[0]
        return y, e

    @staticmethod
    def backward(ctx, gy, ge):
        n = ctx.rows
        head, tail = gy[: 2 * n], gy[2 * n :]
        gh = head + torch.cat([torch.zeros_like(tail[:1]), 2 * tail])
        gx = gh.reshape(n, 6)
        ge_rows = (0.25 * ge).unsqueeze(1).expand(-1, 6)
        return gx + torch.zeros_like(gx).slice_scatter(ge_rows, dim=0, step=2)


class PairsNet(torch.nn.Module):
    """A linear layer, Pairs, then archops' ScaledSin and Cube on
    expression-sized tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = Pairs.apply(self.lin(x))
        return archops.ScaledSin.apply(y, 0.5), archops.Cube.apply(y[::2, 0])


class FoldNet(torch.nn.Module):
    """A linear layer, Fold, then archops' ScaledSin and Cube on its results."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        y, e = Fold.apply(self.lin(x))
        return archops.ScaledSin.apply(y, 0.5), archops.Cube.apply(e)
