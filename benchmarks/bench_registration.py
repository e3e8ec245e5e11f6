"""Registration and first call of many distinct Functions: wrapping N classes
and calling each once, against defining the same N ops with
torch.library.custom_op (+ register_fake + register_autograd) and calling each
once (issue #11: at most as costly as custom_op).

    python benchmarks/bench_registration.py [--classes 1000] [--rounds 3]

Kinds: ``hinted`` (forward with type hints: the schema is known when the class
is wrapped) and ``unhinted`` (the schema and the outputs are learned from the
first call). Each round defines fresh classes / ops for every variant, in an
order that rotates from round to round, timed with the calling thread's CPU
time; the ratio to custom_op is taken within the round, then the median and
the spread (min..max) over rounds are printed. A call is one forward and one
backward (torch.autograd.grad) at size 16.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import torch_opaque

_SEQ = itertools.count()
_KEEP: list = []  # the classes stay alive, as a package's classes do


def _hinted_fwd(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
    ctx.save_for_backward(x)
    ctx.k = k
    return x.sin() * k


def _unhinted_fwd(ctx, x, k):
    ctx.save_for_backward(x)
    ctx.k = k
    return x.sin() * k


def _bwd(ctx, g):
    (x,) = ctx.saved_tensors
    return g * x.cos() * ctx.k, None


def wrapped(kind: str, n: int, x, g) -> None:
    fwd = _hinted_fwd if kind == "hinted" else _unhinted_fwd
    for _ in range(n):
        name = f"RegBench{next(_SEQ)}"
        cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(_bwd)})
        cls = torch_opaque.wrap(cls, name=name)
        _KEEP.append(cls)
        torch.autograd.grad(cls.apply(x, 0.5), x, g)


def custom_op(n: int, x, g) -> None:
    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.k = inputs[1]

    for _ in range(n):

        def impl(x: torch.Tensor, k: float) -> torch.Tensor:
            return x.sin() * k

        op = torch.library.custom_op(f"opaque_regbench::op{next(_SEQ)}", impl, mutates_args=())
        op.register_fake(lambda x, k: torch.empty_like(x))
        op.register_autograd(_bwd, setup_context=setup)
        torch.autograd.grad(op(x, 0.5), x, g)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=1000, help="classes / ops per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(16, requires_grad=True)
    g = torch.randn(16)
    steps = {
        "custom_op": lambda n: custom_op(n, x, g),
        "hinted": lambda n: wrapped("hinted", n, x, g),
        "unhinted": lambda n: wrapped("unhinted", n, x, g),
    }
    for step in steps.values():  # warm-up: first-use costs of torch.library and torch_opaque
        step(5)
    names = list(steps)
    per_round: dict = {v: [] for v in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for v in order:
            t0 = time.thread_time()
            steps[v](args.classes)
            per_round[v].append(time.thread_time() - t0)
    print(
        f"torch {torch.__version__}: define {args.classes} Functions / ops and call each once "
        f"(fwd+bwd, size 16); {args.rounds} paired rounds, thread CPU time\n"
    )
    print("| variant | median s | ms per class | ratio to custom_op (median [min..max]) |")
    print("|---|---|---|---|")
    for v in names:
        rs = [a / b for a, b in zip(per_round[v], per_round["custom_op"])]
        med = statistics.median(per_round[v])
        print(
            f"| {v} | {med:.2f} | {1e3 * med / args.classes:.2f} | "
            f"{statistics.median(rs):.2f} [{min(rs):.2f}..{max(rs):.2f}] |"
        )


if __name__ == "__main__":
    main()
