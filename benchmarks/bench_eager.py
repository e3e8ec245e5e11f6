"""Eager per-call overhead of a wrapped autograd.Function.

Compares, on a small tensor, forward+backward and forward-only cost of:

  original   Foo.apply of a plain (unwrapped) autograd.Function
  wrapped    Foo.apply after torch_opaque.op(name="BenchFoo")
  torch.ops  torch.ops.opaque.BenchFoo.<overload>(x), the path ep.module() runs
  custom_op  torch.library.custom_op + register_autograd (the upstream alternative)

fwd+bwd: one call on a leaf that requires grad, then one backward into it.
fwd-only: one call with grad mode off on a tensor that does not require grad.
Timing: time.perf_counter around loops of calls, 1 thread, gc left on; the
median over repeats (interleaved across variants) is reported.

Usage::

    python benchmarks/bench_eager.py            # ~15-30 s on 2 cores
    python benchmarks/bench_eager.py --quick    # ~5 s
    python benchmarks/bench_eager.py --size 1024

Prints a table and PASS/MISS lines for the overhead targets; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_opaque


def _forward(ctx, x):
    ctx.save_for_backward(x)
    return x.sin()


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * x.cos()


class FooOriginal(torch.autograd.Function):
    forward = staticmethod(_forward)
    backward = staticmethod(_backward)


@torch_opaque.op(name="BenchFoo")
class FooWrapped(torch.autograd.Function):
    forward = staticmethod(_forward)
    backward = staticmethod(_backward)


@torch.library.custom_op("opaque_bench::foo_sin", mutates_args=())
def foo_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@foo_sin.register_fake
def _(x):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


foo_sin.register_autograd(_backward, setup_context=_setup_context)


def variants(x: torch.Tensor) -> dict:
    FooWrapped.apply(x)  # defines the overload on first use
    (overload,) = torch_opaque.lookup(FooWrapped).overloads.values()
    return {
        "original Foo.apply": FooOriginal.apply,
        "wrapped Foo.apply": FooWrapped.apply,
        f"torch.ops ({overload.op})": overload.op,
        "custom_op": foo_sin,
    }


def fwd_bwd_step(fn, x, g, public: bool):
    """One forward and one backward. By default the backward calls the autograd
    engine directly: torch.autograd.grad adds ~60 us of Python (_make_grads) per
    call in torch 2.13, the same for every variant, which would hide the op's cost."""
    if public:
        grad = torch.autograd.grad
        return lambda: grad(fn(x), x, g)
    run_backward = torch.autograd.graph.Variable._execution_engine.run_backward
    inputs, grads = (x,), (g,)
    return lambda: run_backward((fn(x),), grads, False, False, inputs, False, False)


def fwd_step(fn, x):
    return lambda: fn(x)  # timed with grad mode off (see measure)


def measure(steps: dict, iters: int, repeats: int, warmup: int) -> dict:
    """Median seconds per call of each step. Repeats are interleaved across the
    steps so that drift in machine speed affects all variants alike."""
    samples = {key: [] for key in steps}
    for r in range(repeats + 1):  # round 0 is the warmup
        for (name, mode), step in steps.items():
            n = warmup if r == 0 else iters
            with torch.set_grad_enabled(mode == "fwd+bwd"):
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                dt = time.perf_counter() - t0
            if r:
                samples[(name, mode)].append(dt / n)
    return {key: statistics.median(v) for key, v in samples.items()}


def check(fn, x, g):
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(y, x.detach().sin())
    torch.testing.assert_close(dx, g * x.detach().cos())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    p.add_argument("--size", type=int, default=16, help="number of elements (default 16)")
    p.add_argument("--iters", type=int, help="calls per repeat (default 2000, quick 300)")
    p.add_argument("--repeats", type=int, help="repeats, median taken (default 7, quick 3)")
    p.add_argument(
        "--public-backward",
        action="store_true",
        help="backward via torch.autograd.grad instead of the engine directly",
    )
    args = p.parse_args(argv)
    iters = args.iters or (300 if args.quick else 2000)
    repeats = args.repeats or (3 if args.quick else 7)
    warmup = 50 if args.quick else 200

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.size, dtype=torch.float32, requires_grad=True)
    g = torch.randn(args.size)
    x_ng = x.detach()

    fns = variants(x)
    steps = {}
    for name, fn in fns.items():
        check(fn, x, g)
        steps[(name, "fwd+bwd")] = fwd_bwd_step(fn, x, g, args.public_backward)
        steps[(name, "fwd")] = fwd_step(fn, x_ng)
    res = measure(steps, iters, repeats, warmup)
    table = [(name, res[(name, "fwd+bwd")] * 1e6, res[(name, "fwd")] * 1e6) for name in fns]

    bwd = "torch.autograd.grad" if args.public_backward else "engine.run_backward"
    print(
        f"torch {torch.__version__}, shape ({args.size},) float32, 1 thread, backward via "
        f"{bwd}; median of {repeats} x {iters} calls (warmup {warmup})\n"
    )
    (_, o_fb, o_fo) = table[0]
    w = max(len(r[0]) for r in table) + 2
    header = f"{'variant':<{w}}{'fwd+bwd us/call':>17}{'ratio':>8}{'fwd-only us/call':>18}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, fb, fo in table:
        print(f"{name:<{w}}{fb:>17.2f}{fb / o_fb:>7.2f}x{fo:>18.2f}{fo / o_fo:>7.2f}x")

    _, (_, w_fb, w_fo), (_, t_fb, t_fo), (_, c_fb, c_fo) = table
    targets = [
        ("wrapped apply <= 1.10x original", w_fb / o_fb, w_fo / o_fo, 1.10),
        ("torch.ops path <= 1.50x original", t_fb / o_fb, t_fo / o_fo, 1.50),
        ("wrapped apply <= 0.50x custom_op", w_fb / c_fb, w_fo / c_fo, 0.50),
        ("torch.ops path <= 0.50x custom_op", t_fb / c_fb, t_fo / c_fo, 0.50),
    ]
    print(f"\n{'target':<36}{'fwd+bwd':>14}{'fwd-only':>15}")
    for label, r_fb, r_fo, limit in targets:
        verdict = lambda r: f"{'PASS' if r <= limit else 'MISS'} {r:5.2f}x"  # noqa: E731
        print(f"{label:<36}{verdict(r_fb):>14}{verdict(r_fo):>15}")


if __name__ == "__main__":
    main()
