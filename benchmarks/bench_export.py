"""Export and compile time of a model with many calls of a wrapped Function,
against the same model with the stock Function (issue #11: export at most
1.2x; torch.compile ahead of stock).

    python benchmarks/bench_export.py [--calls 500] [--rounds 3] [--what export,compile]
                                      [--backend aot_eager]

Both variants run in one process, in alternating order each round. export:
torch.export.export (non-strict), then run_decompositions(). compile: a fresh
torch.compile(model, backend=...) (after torch._dynamo.reset()) and its first
call, forward and backward (input that requires grad): Dynamo tracing, AOT
autograd's joint graph and the backend's compilation. The tables give the
median time per variant and the median of the per-round ratios, with the
spread. Timings are process CPU time (the work runs in this thread; Inductor's
compile workers, if any, are not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_opaque


def make_function(name: str, wrapped: bool):
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k: float):
            ctx.save_for_backward(x)
            ctx.k = k
            return torch.sin(x) * k

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.cos(x) * ctx.k, None

    Scaled.__qualname__ = name
    return torch_opaque.wrap(Scaled, name=name) if wrapped else Scaled


class Chain(torch.nn.Module):
    def __init__(self, fn, calls: int):
        super().__init__()
        self.fn, self.calls = fn, calls

    def forward(self, x):
        for i in range(self.calls):
            x = self.fn.apply(x, 1.0 + 1e-3 * (i % 7))
        return x


def export_time(model, x) -> float:
    torch._dynamo.reset()
    t0 = time.process_time()
    ep = torch.export.export(model, (x,), strict=False)
    ep.run_decompositions()
    return time.process_time() - t0


def compile_time(model, x, backend: str) -> float:
    torch._dynamo.reset()
    x = x.detach().requires_grad_()
    t0 = time.process_time()
    compiled = torch.compile(model, backend=backend)
    compiled(x).sum().backward()
    return time.process_time() - t0


def paired(models: dict, measure, rounds: int, title: str) -> None:
    for m in models.values():  # registration, first calls and lazy imports are not counted
        measure(m)
    times: dict = {k: [] for k in models}
    ratios = []
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        got = {k: measure(models[k]) for k in order}
        for k, v in got.items():
            times[k].append(v)
        ratios.append(got["wrapped"] / got["stock"])
    print(f"{title}, {rounds} rounds (CPU s)")
    print("| variant | median s | ratio to stock (median [min..max]) |")
    print("|---|---|---|")
    print(f"| stock | {statistics.median(times['stock']):.2f} | 1.00 |")
    print(
        f"| wrapped | {statistics.median(times['wrapped']):.2f} | "
        f"{statistics.median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}] |"
    )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--what", default="export,compile", help="export and/or compile")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend (default aot_eager)")
    args = ap.parse_args()
    x = torch.randn(16)
    models = {
        "stock": Chain(make_function("BenchExportStock", False), args.calls),
        "wrapped": Chain(make_function("BenchExportWrapped", True), args.calls),
    }
    what = args.what.split(",")
    if "export" in what:
        title = f"torch.export + run_decompositions of {args.calls} calls"
        paired(models, lambda m: export_time(m, x), args.rounds, title)
    if "compile" in what:
        title = f"torch.compile (backend {args.backend}), first fwd+bwd of {args.calls} calls"
        paired(models, lambda m: compile_time(m, x, args.backend), args.rounds, title)


if __name__ == "__main__":
    main()
