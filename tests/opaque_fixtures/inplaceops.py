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


class AutocastNet(torch.nn.Module):
    """The in-place call under autocast (Note [Autocast in the call]): a
    decomposed program calls the op's in-place autocast variant."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, torch.eye(x.shape[-1]))  # bfloat16
            return scale_(h, 3.0) + 1
