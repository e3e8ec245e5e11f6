"""Memory retained per Function class that is created, used and dropped.

A loop makes one autograd.Function class per iteration (a factory, as
optimisation-layer packages do), wraps it (explicitly, or through auto()),
runs forward and backward once and drops it. Before Note [Registry lifetime]
every class kept its op registrations for the rest of the process.

    python benchmarks/bench_class_memory.py [--n 2000]

Prints a table: resident memory growth per class after a warm-up.
"""

import argparse
import gc
import os
import sys

import torch

import torch_opaque


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def make(k):
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k

    # Distinct names, so that versions of torch_opaque without per-class name
    # suffixes (factory classes) can be measured too.
    Scaled.__qualname__ = f"Scaled{k}"
    return Scaled


def one(mode: str, k: int) -> None:
    cls = make(float(k))
    x = torch.ones(4, requires_grad=True)
    if mode == "wrap":
        torch_opaque.wrap(cls)
        cls.apply(x).sum().backward()
    elif mode == "auto":
        with torch_opaque.auto():
            cls.apply(x).sum().backward()
    else:
        cls.apply(x).sum().backward()


def measure(mode: str, n: int) -> float:
    base = {"stock": 0, "wrap": 10**6, "auto": 2 * 10**6}[mode]
    for k in range(200):  # warm-up: allocator pools, caches
        one(mode, base + k)
    gc.collect()
    start = rss_kib()
    for k in range(200, 200 + n):
        one(mode, base + k)
        if k % 50 == 0:
            gc.collect()
    gc.collect()
    return (rss_kib() - start) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--modes", default="stock,wrap,auto")
    a = p.parse_args()
    print(f"torch {torch.__version__}, torch_opaque from {os.path.dirname(torch_opaque.__file__)}")
    print(f"| mode | classes | retained KiB per class |")
    print(f"|---|---|---|")
    for mode in a.modes.split(","):
        print(f"| {mode} | {a.n} | {measure(mode, a.n):.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
