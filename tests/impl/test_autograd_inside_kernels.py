"""Autograd inside a Function's forward and backward (Note [User code sees autograd]).

Stock PyTorch runs a Function's forward under no_grad but with the whole
dispatcher, so ``with torch.enable_grad():`` builds a graph there, and its
backward with the engine's grad mode, so a backward may recompute and call
``torch.autograd.grad`` or ``.backward()`` itself (reentrant backward: what
the recompute-in-backward idiom and every reentrant checkpoint do). Each case
runs the same Function stock, wrapped and under auto(), for several steps,
and compares values, gradients and what the code saw of grad mode.
"""

import pytest
import torch

import torch_opaque
from conftest import op_calls
from torch_opaque._impl import function as F


class RecomputeInBackward(torch.autograd.Function):
    """Saves only the input; the backward rebuilds the graph and differentiates it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.tanh(x @ w) * 2

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wd = w.detach().requires_grad_(ctx.needs_input_grad[1])
            y = torch.tanh(xd @ wd) * 2
            inputs = [t for t in (xd, wd) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, g))
        return tuple(next(grads) if t.requires_grad else None for t in (xd, wd))


class NestedBackward(torch.autograd.Function):
    """The backward calls .backward() on a graph of its own (reentrant), reads .grad."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin() * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            (xd.sin() * xd).backward(g)
        return xd.grad


class GraphInForward(torch.autograd.Function):
    """The forward differentiates a function of the input (an energy's force)."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            energy = (xd**4).sum() / 4
            (force,) = torch.autograd.grad(energy, xd)
        ctx.save_for_backward(x)
        return force  # x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


SEEN = []


class SeesModes(torch.autograd.Function):
    """Records the grad modes its forward and backward run under."""

    @staticmethod
    def forward(ctx, x):
        SEEN.append(("forward", torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        SEEN.append(("backward", torch.is_grad_enabled()))
        return g * 2


class QueuesCallback(torch.autograd.Function):
    """The backward queues an engine callback (run when the whole backward ends)."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        SEEN.append("backward")
        torch.autograd.Variable._execution_engine.queue_callback(lambda: SEEN.append("callback"))
        return g * 3


def variants(cls):
    """(label, apply) for stock, wrap of a copy, and the stock class under auto()."""
    wrapped = torch_opaque.wrap(type(cls.__name__, (cls,), {"__module__": "user_models"}))
    under_auto = type(cls.__name__, (cls,), {"__module__": "user_models"})
    return [("stock", cls.apply, None), ("wrap", wrapped.apply, None), ("auto", under_auto.apply, "auto")]


def run_steps(apply, mode, make_inputs, steps=3):
    """Values and gradients of a few steps (the first eager call is special: Note
    [First call runs forward once])."""
    results = []
    ctx = torch_opaque.auto() if mode else None
    if ctx is not None:
        report = ctx.__enter__()
    try:
        for step in range(steps):
            torch.manual_seed(step)
            inputs = make_inputs()
            out = apply(*inputs)
            out.sum().backward()
            results.append((out.detach(), [None if t.grad is None else t.grad.clone() for t in inputs]))
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
            assert not report.fallbacks, report.fallbacks
    return results


def assert_same(a, b):
    for (out_a, grads_a), (out_b, grads_b) in zip(a, b):
        torch.testing.assert_close(out_a, out_b)
        for ga, gb in zip(grads_a, grads_b):
            assert (ga is None) == (gb is None)
            if ga is not None:
                torch.testing.assert_close(ga, gb)


CASES = {
    "recompute_both": (RecomputeInBackward, lambda: (torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True))),
    "recompute_one": (RecomputeInBackward, lambda: (torch.randn(4, 3, requires_grad=True), torch.randn(3, 2))),
    "nested_backward": (NestedBackward, lambda: (torch.randn(5, requires_grad=True),)),
    "graph_in_forward": (GraphInForward, lambda: (torch.randn(5, requires_grad=True),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_autograd_inside_matches_stock(case):
    cls, make = CASES[case]
    (_, stock, _), *others = variants(cls)
    ref = run_steps(stock, None, make)
    for label, apply, mode in others:
        assert_same(run_steps(apply, mode, make), ref)


def test_grad_modes_seen_by_user_code_match_stock():
    """Forward: grad mode and forward-mode AD off; backward: the engine's grad mode
    (create_graph), as THPFunction_apply and the engine set them."""
    seen = {}
    for label, apply, mode in variants(SeesModes):
        SEEN.clear()
        with torch_opaque.auto() if mode else torch.enable_grad():
            for _ in range(2):
                x = torch.randn(3, requires_grad=True)
                y = apply(x)
                (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
                torch.autograd.grad(apply(x).sum(), x)
                with torch.no_grad():
                    apply(x)
        seen[label] = list(SEEN)
    assert seen["stock"][0] == ("forward", False, False)
    assert ("backward", True) in seen["stock"] and ("backward", False) in seen["stock"]
    assert seen["wrap"] == seen["stock"]
    assert seen["auto"] == seen["stock"]


def test_callbacks_queued_inside_backward_run_after_it():
    order = {}
    for label, apply, mode in variants(QueuesCallback):
        SEEN.clear()
        with torch_opaque.auto() if mode else torch.enable_grad():
            for _ in range(2):
                x = torch.randn(3, requires_grad=True)
                (apply(x).sum() * 2).backward()
                SEEN.append("after")
        order[label] = list(SEEN)
    assert order["stock"] == ["backward", "callback", "after"] * 2
    assert order["wrap"] == order["stock"] and order["auto"] == order["stock"]


def test_recompute_backward_trains_under_reentrant_checkpoint():
    """The op inside torch.utils.checkpoint(use_reentrant=True), whose own backward
    reruns the forward with grad enabled and backwards through it."""
    wrapped = torch_opaque.wrap(type("RecomputeInBackward", (RecomputeInBackward,), {}))

    def run(apply):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 2, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(lambda a, b: apply(a, b).exp(), x, w, use_reentrant=True)
        out.sum().backward()
        return out.detach(), x.grad, w.grad

    for a, b in zip(run(wrapped.apply), run(RecomputeInBackward.apply)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recompute_backward_compiles_as_one_op(backend):
    """Compiled training: `_bwd` runs the reentrant backward (on fake tensors while
    tracing, for real in the compiled backward) and stays one node."""
    wrapped = torch_opaque.wrap(type("RecomputeInBackward", (RecomputeInBackward,), {}))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    backend_fn = backend
    if backend == "aot_eager":
        def keep(gm, _):
            graphs.append(gm)
            return make_boxed_func(gm)

        backend_fn = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def model(apply, x, w):
        return (apply(x, w) + 1).pow(2)

    compiled = torch.compile(lambda x, w: model(wrapped.apply, x, w), backend=backend_fn, fullgraph=True)
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 2, requires_grad=True)
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = compiled(x, w)
        out.sum().backward()
        ref = model(RecomputeInBackward.apply, xs, ws)
        ref.sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, xs.grad)
        torch.testing.assert_close(w.grad, ws.grad)
    if backend == "aot_eager":
        name = F.lookup(wrapped).name
        fw, bw = graphs[0], graphs[1]
        assert len(op_calls(fw, name)) == 1 and len(op_calls(bw, name)) == 1
