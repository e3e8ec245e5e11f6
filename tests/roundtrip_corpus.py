"""Functions written the way published packages write them, each in a small
model: the corpus of the round-trip property test
(tests/archive/test_archive_roundtrip.py).

Every backward is deliberately not the derivative autograd would compute
(a straight-through estimator, a scaled or shifted gradient), so a path that
drops the custom backward and differentiates the forward shows.

A case is built by ``build(name)``: the model, the example inputs torch.export
sees, the inputs the programs run on (another batch size where the batch is
dynamic), which inputs require grad, and a seed set before every call (random
ops). The Functions live here, in a module the loading process cannot import
(it has only the repository root on its path): a self-contained archive must
carry everything they do.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, List, Optional

import numpy as np
import torch
from torch.autograd import Function

BATCH = torch.export.Dim("batch", min=2, max=64)


@dataclasses.dataclass
class Case:
    model: torch.nn.Module
    args: tuple  # what torch.export sees
    run_args: Optional[tuple] = None  # what the programs run on (default: args)
    dynamic_shapes: object = None
    grad: Optional[tuple] = None  # per arg: requires grad (default: floating tensors)
    seed: Optional[int] = None  # torch.manual_seed before every call (random ops)
    atol: float = 1e-5

    def __post_init__(self):
        if self.run_args is None:
            self.run_args = self.args
        if self.grad is None:
            self.grad = tuple(isinstance(a, torch.Tensor) and a.is_floating_point() for a in self.args)


BUILDERS: dict = {}


def case(name: str):
    def register(builder: Callable[[], Case]):
        assert name not in BUILDERS, name
        BUILDERS[name] = builder
        return builder

    return register


def build(name: str) -> Case:
    torch.manual_seed(0)
    c = BUILDERS[name]()
    c.model.eval()  # the same in every path (no module in the corpus reads it)
    return c


class Call(torch.nn.Module):
    """A model that calls `fn(*inputs, *extra)` (extra: non-tensor arguments)."""

    def __init__(self, fn, *extra, params: int = 0, shape=(3,)):
        super().__init__()
        self.fn, self.extra = fn, extra
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape)) for _ in range(params)])

    def forward(self, *inputs):
        return self.fn(*inputs, *self.ps, *self.extra)


def x(*shape, dtype=torch.float32):
    return torch.randn(shape or (4, 3), dtype=dtype)


def simple(fn, *extra, params=0, shape=(4, 3), **kw) -> Callable[[], Case]:
    return lambda: Case(Call(fn, *extra, params=params, shape=shape[1:]), (x(*shape),), **kw)


def dynamic(fn, *extra, params=0, **kw) -> Callable[[], Case]:
    return lambda: Case(
        Call(fn, *extra, params=params), (x(4, 3),), run_args=(x(7, 3),), dynamic_shapes=(({0: BATCH},),), **kw
    )


# ---- plain Functions: saved tensors, ctx attributes ------------------------------------------


class HalfCos(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * 0.5


class RoundSTE(Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledTanh(Function):
    @staticmethod
    def forward(ctx, x, scale: float, shift: int, flip: bool):
        ctx.scale, ctx.shift, ctx.flip = scale, shift, flip
        y = torch.tanh(x) * scale + shift
        ctx.save_for_backward(y)
        return -y if flip else y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        g = -g if ctx.flip else g
        return g * (1 + ctx.shift) * ctx.scale, None, None, None


class SizeTuple(Function):
    """ctx holds a torch.Size, a tuple and a list."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.dims, ctx.sizes = x.shape, (0, 1), [x.shape[-1], 2]
        return x.reshape(-1).exp()

    @staticmethod
    def backward(ctx, g):
        assert ctx.dims == (0, 1) and isinstance(ctx.sizes, list)
        return (g * ctx.sizes[1]).reshape(ctx.shape)


class NumpyScalars(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.alpha, ctx.n, ctx.on = np.float32(0.25), np.int64(3), np.bool_(True)
        return x * float(ctx.alpha) + int(ctx.n)

    @staticmethod
    def backward(ctx, g):
        return g * float(ctx.alpha) * int(ctx.n) if ctx.on else g


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class EnumCtx(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mode = Mode.FAST
        return x.sigmoid()

    @staticmethod
    def backward(ctx, g):
        return g * (3.0 if ctx.mode is Mode.FAST else 1.0)


class IntEnumCtx(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.level = Level.HIGH
        return x.sigmoid()

    @staticmethod
    def backward(ctx, g):
        return g * int(ctx.level)


class DictCtx(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.cfg = {"gain": 2.0, "bias": 1}
        return x * ctx.cfg["gain"] + ctx.cfg["bias"]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.cfg["gain"] * 0.5


class StrDtypeNone(Function):
    """ctx holds a str, a torch.dtype, None and a float."""

    @staticmethod
    def forward(ctx, x, reduction: str):
        ctx.reduction, ctx.dtype, ctx.extra, ctx.eps = reduction, x.dtype, None, 1e-3
        return (x.double() ** 2).sum(-1) if reduction == "sum" else (x.double() ** 2).mean(-1)

    @staticmethod
    def backward(ctx, g):
        assert ctx.extra is None
        k = 1.0 if ctx.reduction == "sum" else 0.5
        return (g.unsqueeze(-1) * k + ctx.eps).to(ctx.dtype).expand(-1, 3), None


class SetupStyle(Function):
    """forward without ctx, setup_context apart (torch >= 2.0 style)."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * 2, (g * x).sum(0)


class SavesOutput(Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y.sqrt()


class TwoOutputs(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, ga, gb):
        (x,) = ctx.saved_tensors
        return ga * 2 - gb * x


class SortNonDiff(Function):
    """values and int64 indices; the indices are marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        v, i = torch.sort(x, dim=-1)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(i)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        (i,) = ctx.saved_tensors
        return torch.zeros_like(gv).scatter(-1, i, gv * 3)


class MaskNonDiff(Function):
    """A float output marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(mask)
        return x * mask, mask

    @staticmethod
    def backward(ctx, g, _):
        (mask,) = ctx.saved_tensors
        return g * (mask + 0.1)


class NoneGrad(Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * y.detach().abs()

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class NeedsInputGrad(Function):
    """A linear layer that computes only the gradients that are needed."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = g @ w * 2
        if ctx.needs_input_grad[1]:
            gw = g.t() @ x + 1
        return gx, gw


class PACT(Function):
    """A clip with a learnable upper bound (quantization toolkits): the bound's
    gradient only when it requires grad."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x, alpha)
        ctx.alpha_grad = alpha.requires_grad
        return torch.minimum(torch.relu(x), alpha)

    @staticmethod
    def backward(ctx, g):
        x, alpha = ctx.saved_tensors
        gx = g * ((x >= 0) & (x <= alpha))
        ga = (g * (x > alpha)).sum().reshape(alpha.shape) * 2 if ctx.alpha_grad else None
        return gx, ga


class NoMaterialize(Function):
    """set_materialize_grads(False): the unused output's gradient is None."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        out = ga * 2 if ga is not None else 0.0
        return out + (gb * 3 if gb is not None else 1.0)


class OnceDiff(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.abs()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sign(x) * 0.5


class OptionalBias(Function):
    @staticmethod
    def forward(ctx, x, bias: Optional[torch.Tensor] = None, eps: float = 1e-2):
        ctx.has_bias, ctx.eps = bias is not None, eps
        return x * 2 + (bias if bias is not None else eps)

    @staticmethod
    def backward(ctx, g):
        return g * 3, (g.sum(0) if ctx.has_bias else None), None


class PermuteList(Function):
    @staticmethod
    def forward(ctx, x, dims: List[int]):
        ctx.dims = list(dims)
        return x.permute(dims).contiguous()

    @staticmethod
    def backward(ctx, g):
        inv = [ctx.dims.index(i) for i in range(len(ctx.dims))]
        return g.permute(inv) * 2, None


class StackList(Function):
    @staticmethod
    def forward(ctx, xs: List[torch.Tensor]):
        ctx.n = len(xs)
        return torch.stack(xs).sum(0)

    @staticmethod
    def backward(ctx, g):
        return None


class Gather(Function):
    """An int64 index input (no gradient)."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return x.gather(1, idx)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return g.new_zeros(ctx.shape).scatter_add(1, idx, g * 2), None


class GradientBlocker(Function):
    """A backward that returns no gradient at all (a straight-through blocker):
    its stored backward has no outputs (Note [A backward with no gradients])."""

    @staticmethod
    def forward(ctx, x):
        return (x * 3).round()

    @staticmethod
    def backward(ctx, g):
        return None


class ZeroDim(Function):
    """A 0-d result (a loss-like Function)."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return (x**2).mean()

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape) * 0.1


class Double(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.double() ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (g * x.double()).to(x.dtype)


class InPlaceIntermediate(Function):
    """In-place ops on the forward's own intermediates (not its inputs)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        y[y < 0] = 0
        y.mul_(2).add_(1)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0) * 1.5


class Identity(Function):
    """Returns its input (an alias: operators return a copy)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 4


def make_power(p: float):
    """A factory of Functions (one class per call, same qualified name)."""

    class Power(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.abs() ** p

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * p * torch.sign(x)

    return Power


Square, Cube = make_power(2.0), make_power(3.0)
half_cos = HalfCos.apply  # an alias of apply, as packages export them


# ---- random ops -------------------------------------------------------------------------------


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p: float):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask * 0.5, None


class StochasticRound(Function):
    @staticmethod
    def forward(ctx, x):
        return torch.floor(x * 8 + torch.rand_like(x)) / 8

    @staticmethod
    def backward(ctx, g):
        return g * 0.9


class SeededNoise(Function):
    """Its own generator, seeded from an argument (a torch.Generator in the
    forward)."""

    @staticmethod
    def forward(ctx, x, seed: int):
        g = torch.Generator().manual_seed(seed)
        return x + torch.randn(x.shape, generator=g)

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


# ---- autocast ---------------------------------------------------------------------------------


class CastFp32(Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * 0.5


class AutocastMatmul(Function):
    """Its forward's matmul autocasts (no custom_fwd)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g @ w.t().to(g.dtype)) * 2, x.t().to(g.dtype) @ g


class Autocast(torch.nn.Module):
    def __init__(self, fn, with_weight: bool):
        super().__init__()
        self.fn = fn
        self.w = torch.nn.Parameter(torch.randn(3, 3)) if with_weight else None

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ torch.ones(3, 3) if self.w is None else x
            out = self.fn(y) if self.w is None else self.fn(y, self.w)
        return out.float()


# ---- control flow, dynamic sizes ----------------------------------------------------------------


class ShapeBranch(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.wide = x.shape[-1] > 2
        return x.sin() if ctx.wide else x.cos()

    @staticmethod
    def backward(ctx, g):
        return g * (2.0 if ctx.wide else -1.0)


class BatchMean(Function):
    """ctx holds the (dynamic) batch size."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0]
        return x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.n, -1) / ctx.n * 3


class BatchArithmetic(Function):
    """Scales by sizes computed from the (dynamic) batch."""

    @staticmethod
    def forward(ctx, x):
        ctx.h = x.shape[0] - 1
        return x * (x.shape[0] // 2)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.h


# ---- grad-mode regions ----------------------------------------------------------------------


class NoGradForward(Function):
    """Statistics under no_grad in the forward (a spiking neuron's threshold)."""

    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            thr = x.abs().mean(-1, keepdim=True)
        ctx.save_for_backward(x, thr)
        return (x > thr).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, thr = ctx.saved_tensors
        return g / (1 + (x - thr).abs())


class SetGradForward(Function):
    @staticmethod
    def forward(ctx, x):
        with torch.set_grad_enabled(False):
            y = torch.sort(x, -1).values
        return y + 1

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class NoGradBackward(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return g * (1 - x.tanh() ** 2) * 2


class NoSecondDerivative(Function):
    @staticmethod
    def forward(ctx, x):
        return x.relu()

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise RuntimeError("NoSecondDerivative: no second derivative")
        return g * 0.5


class Recompute(Function):
    """Recomputes the forward under enable_grad and calls autograd.grad."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin() * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            y = xx.sin() * xx
            (gx,) = torch.autograd.grad(y, xx, g)
        return gx * 2


class CondForward(Function):
    @staticmethod
    def forward(ctx, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))

    @staticmethod
    def backward(ctx, g):
        return g * 2


# ---- several and nested Functions --------------------------------------------------------------


class Outer(Function):
    """Its forward calls another Function."""

    @staticmethod
    def forward(ctx, x):
        return HalfCos.apply(x) * 2

    @staticmethod
    def backward(ctx, g):
        return g * 7


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = RoundSTE.apply(self.lin(x))
        y = ScaledTanh.apply(y, 0.5, 1, False) + HalfCos.apply(x)
        v, _ = SortNonDiff.apply(y)
        return SavesOutput.apply(v * 0.1)


class TwoCalls(torch.nn.Module):
    """One Function called with two different non-tensor arguments."""

    def forward(self, x):
        return ScaledTanh.apply(x, 2.0, 0, False) + ScaledTanh.apply(x, 0.5, 1, True)


class Factories(torch.nn.Module):
    def forward(self, x):
        return Square.apply(x) + Cube.apply(x)


# ---- the cases ------------------------------------------------------------------------------------

case("saved input")(simple(HalfCos.apply))
case("straight-through estimator")(simple(RoundSTE.apply))
case("float, int and bool arguments")(simple(ScaledTanh.apply, 1.5, 2, True))
case("ctx: torch.Size, tuple, list")(simple(SizeTuple.apply))
case("ctx: numpy scalars")(simple(NumpyScalars.apply))
case("ctx: Enum")(simple(EnumCtx.apply))
case("ctx: IntEnum")(simple(IntEnumCtx.apply))
case("ctx: dict")(simple(DictCtx.apply))
case("ctx: str, dtype, None")(simple(StrDtypeNone.apply, "mean"))
case("setup_context style, parameter")(simple(SetupStyle.apply, params=1))
case("saved output")(simple(SavesOutput.apply))
case("two outputs")(simple(TwoOutputs.apply))
case("non-differentiable int output")(simple(SortNonDiff.apply))
case("non-differentiable float output")(simple(MaskNonDiff.apply))
case("None gradient for an input that requires grad")(lambda: Case(Call(NoneGrad.apply), (x(), x())))
case("needs_input_grad: input without grad")(
    lambda: Case(Call(NeedsInputGrad.apply, params=1, shape=(3, 3)), (x(),), grad=(False,))
)
case("needs_input_grad: both")(lambda: Case(Call(NeedsInputGrad.apply, params=1, shape=(3, 3)), (x(),)))
case("requires_grad branch: learnable bound")(
    lambda: Case(Call(PACT.apply, params=1, shape=()), (x(),))
)
case("requires_grad branch: frozen bound")(
    lambda: Case(Call(PACT.apply), (x(), torch.tensor(0.5)), grad=(True, False))
)
case("materialize_grads off")(simple(lambda x: NoMaterialize.apply(x)[0]))
case("once_differentiable")(simple(OnceDiff.apply))
case("Optional tensor: None")(simple(OptionalBias.apply))
case("Optional tensor: given")(lambda: Case(Call(OptionalBias.apply), (x(), x(3)), grad=(True, True)))
case("float default, given")(lambda: Case(Call(OptionalBias.apply, None, 0.5), (x(),)))
case("list of ints")(lambda: Case(Call(PermuteList.apply, [1, 0]), (x(),)))
case("list of tensors")(lambda: Case(Call(lambda a, b: StackList.apply([a, b]) + a), (x(), x())))
case("int64 index input")(lambda: Case(Call(Gather.apply), (x(), torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]]))))
case("backward returns no gradient")(lambda: Case(Call(lambda a: GradientBlocker.apply(a) + a), (x(),)))
case("0-d result")(simple(ZeroDim.apply))
case("float64 result")(simple(Double.apply))
case("in-place ops on intermediates")(simple(InPlaceIntermediate.apply))
case("returns its input")(simple(Identity.apply))
case("factory: two classes, one name")(lambda: Case(Factories(), (x(),)))
case("alias of apply")(simple(half_cos))
case("random: dropout mask")(simple(Dropout.apply, 0.3, seed=1))
case("random: stochastic rounding")(simple(StochasticRound.apply, seed=2))
case("random: a seeded torch.Generator")(simple(SeededNoise.apply, 7))
case("autocast: custom_fwd(cast_inputs)")(lambda: Case(Autocast(CastFp32.apply, False), (x(),), atol=1e-2))
case("autocast: matmul in forward")(lambda: Case(Autocast(AutocastMatmul.apply, True), (x(),), atol=1e-2))
case("control flow on a static size")(simple(ShapeBranch.apply))
case("dynamic batch")(dynamic(HalfCos.apply))
case("dynamic batch: ctx holds the size")(dynamic(BatchMean.apply))
case("dynamic batch: size arithmetic")(dynamic(BatchArithmetic.apply))
case("dynamic batch: several Functions")(
    lambda: Case(Chain(), (x(4, 3),), run_args=(x(6, 3),), dynamic_shapes=({0: BATCH},))
)
case("no_grad in forward")(simple(NoGradForward.apply))
case("set_grad_enabled(False) in forward")(simple(SetGradForward.apply))
case("no_grad in backward")(simple(NoGradBackward.apply))
case("backward refuses grad mode")(simple(NoSecondDerivative.apply))
case("backward recomputes with autograd.grad")(simple(Recompute.apply))
case("torch.cond in forward")(simple(CondForward.apply))
case("nested Functions")(simple(Outer.apply))
case("several Functions, a Linear")(lambda: Case(Chain(), (x(),)))
case("one Function, two calls")(lambda: Case(TwoCalls(), (x(),)))
