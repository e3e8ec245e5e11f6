"""Steady-state speed of compiled code that calls a custom autograd.Function,
against the same code with the stock Function (issue #28).

    python benchmarks/bench_compiled.py [--models mlp6x256,mlp4x512,block]
                                        [--rounds 11] [--steps 200] [--backend inductor]
                                        [--compile-rounds 3] [--compile-calls 100]

Models: ``mlp6x256`` (6 Linear(256) layers, batch 32), ``mlp4x512`` (4
Linear(512), batch 64), each Linear followed by a SiLU-like Function with a
hand-written backward and a float kept on ctx; ``block`` (a pre-norm
transformer block, batch 8, 32 tokens, width 128, 4 heads) whose attention
softmax (a float scale on ctx) and MLP activation are such Functions.

Variants, each its own class (so each has its own op): the stock Function
eager and compiled; the wrapped Function (torch_opaque.wrap) eager, compiled
(Inductor compiles its bodies: Note [Inductor sees through opaque ops]) and
compiled opaque (``torch_opaque.config.inductor_inline = False`` while it
compiles: the op's Python kernels run at run time); and
``torch.library.custom_op`` + ``register_autograd``, compiled.

A step is forward + backward (``loss.backward()`` on the sum of the output,
parameters' gradients reset to None). Each round runs every variant for
``--steps`` steps, in an order that rotates from round to round, each timed
with the thread's CPU time (``time.thread_time``), one thread
(``torch.set_num_threads(1)``); the ratio to stock compiled is taken within
the round. The table gives, per variant, the time per step (median over the
rounds) and the median [min..max] of the per-round ratios. Before timing,
every variant's gradients are compared with stock eager's.

Compile time (``--compile-rounds`` > 0): bench_export.py's chain of
``--compile-calls`` calls of a Function, compiled afresh (``torch._dynamo.reset()``, Inductor's caches
off) and run once forward and backward, stock against wrapped (inlined and
opaque), wall time; median [min..max] of the per-round ratios to stock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_opaque


# ---- the Functions ------------------------------------------------------------------


class SiLUish(torch.autograd.Function):
    """x * sigmoid(beta * x), its backward written by hand, beta kept on ctx."""

    @staticmethod
    def forward(ctx, x, beta: float):
        s = torch.sigmoid(x * beta)
        ctx.save_for_backward(x, s)
        ctx.beta = beta
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * (s + ctx.beta * x * s * (1 - s)), None


class ScaledSoftmax(torch.autograd.Function):
    """softmax(x * scale, -1), its backward written by hand, scale kept on ctx."""

    @staticmethod
    def forward(ctx, x, scale: float):
        y = torch.softmax(x * scale, dim=-1)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True)) * ctx.scale, None


def custom_op_versions(tag: str):
    """The two Functions as torch.library.custom_op with register_autograd."""

    @torch.library.custom_op(f"bench_compiled::silu_{tag}", mutates_args=())
    def silu(x: torch.Tensor, beta: float) -> torch.Tensor:
        return x * torch.sigmoid(x * beta)

    @silu.register_fake
    def _(x, beta):
        return torch.empty_like(x)

    def silu_setup(ctx, inputs, output):
        x, beta = inputs
        ctx.save_for_backward(x)
        ctx.beta = beta

    def silu_backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x * ctx.beta)
        return g * (s + ctx.beta * x * s * (1 - s)), None

    silu.register_autograd(silu_backward, setup_context=silu_setup)

    @torch.library.custom_op(f"bench_compiled::softmax_{tag}", mutates_args=())
    def softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.softmax(x * scale, dim=-1)

    @softmax.register_fake
    def _(x, scale):
        return torch.empty_like(x)

    def softmax_setup(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.scale = inputs[1]

    def softmax_backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True)) * ctx.scale, None

    softmax.register_autograd(softmax_backward, setup_context=softmax_setup)

    class Act:
        apply = staticmethod(silu)

    class Soft:
        apply = staticmethod(softmax)

    return Act, Soft


def function_pair(kind: str, tag: str):
    """(activation, softmax): objects with ``.apply(x, float)``."""
    if kind == "custom_op":
        return custom_op_versions(tag)
    act = type(f"SiLUish_{tag}", (SiLUish,), {})
    soft = type(f"ScaledSoftmax_{tag}", (ScaledSoftmax,), {})
    if kind == "wrapped":
        torch_opaque.wrap(act)
        torch_opaque.wrap(soft)
    return act, soft


# ---- the models ---------------------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self, act, width: int, depth: int):
        super().__init__()
        self.act = act
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for lin in self.layers:
            x = self.act.apply(lin(x), 1.5)
        return x


class Block(torch.nn.Module):
    def __init__(self, act, soft, width: int = 128, heads: int = 4):
        super().__init__()
        self.act, self.soft, self.heads = act, soft, heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = self.soft.apply(q @ k.transpose(-1, -2), (d // h) ** -0.5)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(self.act.apply(self.up(self.norm2(x)), 1.702))


MODELS = {
    "mlp6x256": (lambda act, soft: MLP(act, 256, 6), (32, 256)),
    "mlp4x512": (lambda act, soft: MLP(act, 512, 4), (64, 512)),
    "block": (lambda act, soft: Block(act, soft), (8, 32, 128)),
}

VARIANTS = ("stock eager", "stock compiled", "wrapped eager", "wrapped compiled",
            "wrapped compiled opaque", "custom_op compiled")


def build(model: str, backend: str, x: torch.Tensor) -> dict:
    """variant -> step function (all variants share the stock eager weights)."""
    make, _ = MODELS[model]
    fns = {k: function_pair(k, f"{model}_{k}") for k in ("stock", "wrapped", "custom_op")}
    torch.manual_seed(0)
    reference = make(*fns["stock"])
    steps = {}
    for variant in VARIANTS:
        kind = variant.split()[0]
        m = make(*fns[kind])
        m.load_state_dict(reference.state_dict())
        run = torch.compile(m, backend=backend) if "compiled" in variant else m

        def step(m=m, run=run):
            for p in m.parameters():
                p.grad = None
            run(x).sum().backward()
            return [p.grad for p in m.parameters()]

        torch_opaque.config.inductor_inline = "opaque" not in variant
        try:
            step()  # compiles
        finally:
            torch_opaque.config.inductor_inline = True
        steps[variant] = step
    return steps


def check_gradients(steps: dict) -> None:
    want = steps["stock eager"]()
    for variant, step in steps.items():
        got = step()
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{variant}: {m}")


def timed(steps: dict, rounds: int, n: int) -> tuple:
    names = list(steps)
    per_step = {k: [] for k in names}
    ratios = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        t = {}
        for k in order:
            step = steps[k]
            t0 = time.thread_time()
            for _ in range(n):
                step()
            t[k] = (time.thread_time() - t0) / n
        for k in names:
            per_step[k].append(t[k])
            ratios[k].append(t[k] / t["stock compiled"])
    return per_step, ratios


def speed_table(models, backend: str, rounds: int, n: int) -> None:
    print(f"steady-state fwd+bwd, backend={backend}, 1 thread, {rounds} rounds x {n} steps; "
          f"ratio to stock compiled within each round: median [min..max]\n")
    print("| model | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for model in models:
        torch.manual_seed(1)
        x = torch.randn(*MODELS[model][1])
        steps = build(model, backend, x)
        check_gradients(steps)
        per_step, ratios = timed(steps, rounds, n)
        cells = []
        for k in VARIANTS:
            rs = ratios[k]
            us = statistics.median(per_step[k]) * 1e6
            cells.append(f"{statistics.median(rs):.2f}x [{min(rs):.2f}..{max(rs):.2f}] "
                         f"({us:.0f} us)")
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


def compile_table(backend: str, rounds: int, calls: int) -> None:
    import torch._inductor.config as inductor_config

    from bench_export import Chain, make_function  # the chain bench_export.py compiles

    variants = {"stock": make_function("ChainStock", False),
                "wrapped": make_function("ChainWrapped", True)}
    x = torch.randn(64)

    def measure(fn, inline: bool) -> float:
        torch._dynamo.reset()
        torch_opaque.config.inductor_inline = inline
        xi = x.detach().requires_grad_()
        try:
            with inductor_config.patch(force_disable_caches=True):
                t0 = time.perf_counter()
                torch.compile(Chain(fn, calls), backend=backend)(xi).sum().backward()
                return time.perf_counter() - t0
        finally:
            torch_opaque.config.inductor_inline = True

    cases = {"stock": (variants["stock"], True), "wrapped (inlined)": (variants["wrapped"], True),
             "wrapped (opaque)": (variants["wrapped"], False)}
    for fn, inline in cases.values():  # first calls, registration and lazy imports not counted
        measure(fn, inline)
    times = {k: [] for k in cases}
    for r in range(rounds):
        order = list(cases)[r % len(cases):] + list(cases)[: r % len(cases)]
        for k in order:
            times[k].append(measure(*cases[k]))
    print(f"\ncompile + first fwd+bwd of {calls} calls, backend={backend}, caches off, "
          f"{rounds} rounds (wall time; ratio to stock within each round)\n")
    print("| variant | time | ratio to stock |")
    print("|---|---|---|")
    for k in cases:
        rs = [a / b for a, b in zip(times[k], times["stock"])]
        print(f"| {k} | {statistics.median(times[k]):.2f} s | "
              f"{statistics.median(rs):.2f}x [{min(rs):.2f}..{max(rs):.2f}] |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp6x256,mlp4x512,block")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--compile-rounds", type=int, default=3)
    p.add_argument("--compile-calls", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(1)
    models = [m for m in a.models.split(",") if m]
    if models:
        speed_table(models, a.backend, a.rounds, a.steps)
    if a.compile_rounds > 0:
        compile_table(a.backend, a.compile_rounds, a.compile_calls)


if __name__ == "__main__":
    main()
