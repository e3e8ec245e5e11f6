"""Functions whose forward or backward reads the autograd state eager runs
them in (Note [Stored programs run in eager's state] in
torch_opaque/archive/trace.py), written the way packages write them, and the
small models that call them. Used by tests/archive/test_archive_trace_state.py;
the process that loads their archives cannot import this module.

Every backward is deliberately not the true derivative (scaled), so a test
can tell the custom backward ran.
"""

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import torch_opaque


@torch_opaque.op(name="StatePactClip")
class PactClip(torch.autograd.Function):
    """PACT-style clip with learnable bounds (a quantization toolkit's): the
    bounds get a gradient only when they require grad."""

    @staticmethod
    def forward(ctx, x, lower, upper):
        ctx.save_for_backward(x, lower, upper)
        return torch.minimum(torch.maximum(x, lower), upper)

    @staticmethod
    def backward(ctx, grad_output):
        x, lower, upper = ctx.saved_tensors
        inside = (x >= lower) & (x <= upper)
        grad_x = grad_output * inside.to(grad_output.dtype) * 0.5
        grad_lower = grad_upper = None
        if lower.requires_grad:
            grad_lower = (grad_output * (x < lower)).sum().reshape(lower.shape)
        if ctx.needs_input_grad[2] and upper.requires_grad:
            grad_upper = (grad_output * (x > upper)).sum().reshape(upper.shape) * 2.0
        return grad_x, grad_lower, grad_upper


class PactNet(torch.nn.Module):
    """The upper bound learns (a Parameter), the lower one is fixed (a buffer)."""

    def __init__(self):
        super().__init__()
        self.upper = torch.nn.Parameter(torch.tensor([0.8]))
        self.register_buffer("lower", torch.tensor([-0.3]))

    def forward(self, x):
        return PactClip.apply(x * 1.5, self.lower, self.upper)


@torch_opaque.op(name="StateLeakySpike")
class LeakySpike(torch.autograd.Function):
    """A leaky spiking neuron (spike, membrane), materialize-grads off: a loss on
    the spikes alone passes None for the membrane's gradient, and the
    backward then takes the spike surrogate alone, scaled otherwise."""

    @staticmethod
    def forward(ctx, mem, beta: float, threshold: float):
        ctx.set_materialize_grads(False)
        spk = (mem > threshold).to(mem.dtype)
        ctx.save_for_backward(mem)
        ctx.beta, ctx.threshold = beta, threshold
        return spk, beta * mem - spk * threshold

    @staticmethod
    def backward(ctx, grad_spk, grad_mem):
        (mem,) = ctx.saved_tensors
        surrogate = 1.0 / (1.0 + (math.pi * (mem - ctx.threshold)) ** 2)
        if grad_mem is None:
            return grad_spk * surrogate, None, None
        grad = grad_mem * ctx.beta
        if grad_spk is not None:
            grad = grad + 0.5 * grad_spk * surrogate
        return grad, None, None


@torch_opaque.op(name="StatePairScale")
class PairScale(torch.autograd.Function):
    """Two inputs, two outputs, materialize-grads off: an input whose output
    takes no part in the loss gets None."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.set_materialize_grads(False)
        return a * 2, b * 3

    @staticmethod
    def backward(ctx, ga, gb):
        return (None if ga is None else ga * 2.5), (None if gb is None else gb * 3.5)


class SpikeNet(torch.nn.Module):
    def __init__(self, use_mem: bool):
        super().__init__()
        self.use_mem = use_mem
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        spk, mem = LeakySpike.apply(self.fc(x), 0.9, 0.2)
        a, b = PairScale.apply(x, y)
        return (spk, mem, a) if self.use_mem else (spk, a)


@torch_opaque.op(name="StateNoSecond")
class NoSecondDerivative(torch.autograd.Function):
    """A backward that refuses grad mode ("no second derivative")."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.expm1(x)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise RuntimeError("NoSecondDerivative has no second derivative; "
                               "do not call backward with create_graph=True")
        (x,) = ctx.saved_tensors
        return g * x.exp() * 0.5


@torch_opaque.op(name="StateOnceDiff")
class OnceDiffSoftplus(torch.autograd.Function):
    """torch.autograd.function.once_differentiable on the backward."""

    @staticmethod
    def forward(ctx, x, beta: float):
        ctx.save_for_backward(x)
        ctx.beta = beta
        return F.softplus(x, beta)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x * ctx.beta) * 0.25, None


class GradModeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return NoSecondDerivative.apply(self.fc(x)) + OnceDiffSoftplus.apply(x, 2.0)


@torch_opaque.op(name="StateRecompute")
class RecomputeGelu(torch.autograd.Function):
    """Saves inputs only and recomputes under enable_grad in backward, taking
    the gradients with torch.autograd.grad (activation-checkpoint style)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.gelu(x @ weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(ctx.needs_input_grad[0])
            w_ = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            y = F.gelu(x_ @ w_)
        wanted = [t for t in (x_, w_) if t.requires_grad]
        got = iter(torch.autograd.grad(y, wanted, g * 0.5)) if wanted else iter(())
        return tuple(next(got) if t.requires_grad else None for t in (x_, w_))


@torch_opaque.op(name="StateRecomputeSaved")
class RecomputeOnSaved(torch.autograd.Function):
    """Recomputes from the saved tensors themselves under enable_grad (they
    require grad in eager's backward) and differentiates with respect to them."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.tanh(x @ weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            y = torch.tanh(x @ weight)
        wanted = [t for t, need in zip((x, weight), ctx.needs_input_grad) if need]
        got = iter(torch.autograd.grad(y, wanted, g * 1.5))
        return tuple(next(got) if need else None for need in ctx.needs_input_grad)


class RecomputeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return RecomputeGelu.apply(x, self.weight) + RecomputeOnSaved.apply(x, self.weight)


@torch_opaque.op(name="StateFakeQuant")
class ExportFakeQuant(torch.autograd.Function):
    """A quantizer only ever called under torch.no_grad() for export: its
    backward returns one gradient for four arguments (never called)."""

    @staticmethod
    def forward(ctx, x, scale, zero_point: int, bits: int):
        q = torch.clamp(torch.round(x / scale) + zero_point, 0, 2**bits - 1)
        return (q - zero_point) * scale

    @staticmethod
    def backward(ctx, g):
        return g


class QuantNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.05))

    def forward(self, x):
        # two kinds of call (shapes): still one warning
        return ExportFakeQuant.apply(x, self.scale, 8, 8), ExportFakeQuant.apply(x[:2], self.scale, 0, 4)


@torch_opaque.op(name="StateWeightedSum")
class WeightedSum(torch.autograd.Function):
    """Fuses a list of feature maps with learnable weights (a feature-pyramid
    fusion layer); the list's tensors get no gradient, as in stock autograd."""

    @staticmethod
    def forward(ctx, features: list, weights):
        ctx.save_for_backward(weights, *features)
        return sum(w * f for w, f in zip(weights, features))

    @staticmethod
    def backward(ctx, g):
        weights, *features = ctx.saved_tensors
        return None, torch.stack([(g * f).sum() for f in features]) * 0.5


class FusionNet(torch.nn.Module):
    """Two list widths: two kinds of call."""

    def __init__(self):
        super().__init__()
        self.w2 = torch.nn.Parameter(torch.tensor([0.4, 0.6]))
        self.w3 = torch.nn.Parameter(torch.tensor([0.2, 0.3, 0.5]))

    def forward(self, x):
        a, b, c = x.tanh(), x.sin(), x * 2
        return WeightedSum.apply([a, b], self.w2) + WeightedSum.apply([a, b, c], self.w3)
