"""An in-place Function (ctx.mark_dirty) for archive tests: a module another
process imports to define the op again."""

import torch

import torch_opaque


@torch_opaque.op(name="ArchScaleInPlace")
class ScaleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        ctx.k = k
        x.mul_(k)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


scale_ = ScaleInPlace.apply  # an alias, as packages keep them


class Net(torch.nn.Module):
    def forward(self, x):
        h = x.sin()
        return scale_(h, 3.0) + x
