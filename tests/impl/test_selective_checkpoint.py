"""Selective activation checkpointing with a policy on the op (Note [Records of
replayed forwards] in csrc/replayed_records.h).

SAC sees a wrapped Function as one unit (`Name_fwd`), where it cannot see a
stock Function at all: MUST_SAVE keeps the op's outputs and residuals, so
checkpoint's recomputation does not run the forward again, and the backward
node of the replayed call takes the record of the call it replays.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torch_opaque

RUNS = []


class Gelu(torch.autograd.Function):
    """Saves its input and an intermediate; ctx holds a float and a tensor."""

    @staticmethod
    def forward(ctx, x, k: float):
        RUNS.append("forward")
        t = torch.tanh(k * x)
        ctx.k = k
        ctx.half = torch.tensor(0.5)
        ctx.save_for_backward(x, t)
        return ctx.half * x * (1 + t)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        return g * ctx.half * (1 + t + x * ctx.k * (1 - t * t)), None


class QuietGelu(Gelu):
    """Gelu without the run counter (a side effect torch.compile refuses: Note [Forward
    side effects])."""

    @staticmethod
    def forward(ctx, x, k: float):
        t = torch.tanh(k * x)
        ctx.k = k
        ctx.half = torch.tensor(0.5)
        ctx.save_for_backward(x, t)
        return ctx.half * x * (1 + t)


def policy_for(name):
    def policy(ctx, op, *args, **kwargs):
        if name in str(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def train(apply, context_fn, steps=3, compiled=None):
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(5, requires_grad=True)
        w = torch.randn(5, requires_grad=True)

        def region(a, b):
            return apply(a.sin() * b, 1.5).cos()

        def body(a, b):
            if context_fn is None:
                return checkpoint(region, a, b, use_reentrant=False)
            return checkpoint(region, a, b, use_reentrant=False, context_fn=context_fn)

        f = compiled(body) if compiled else body
        RUNS.clear()
        y = f(x, w)
        y.sum().backward()
        out.append((y.detach(), x.grad, w.grad, len(RUNS)))
    return out


def wrapped_copy(base=Gelu):
    cls = torch_opaque.wrap(type(base.__name__, (base,), {"__module__": "user_models"}))
    from torch_opaque._impl import function as F

    return cls, F.lookup(cls).name


def test_must_save_on_the_op_keeps_it_out_of_the_recomputation():
    cls, name = wrapped_copy()
    ref = train(Gelu.apply, None)  # stock: the whole region recomputes
    got = train(cls.apply, policy_for(name))
    for (y, gx, gw, runs), (ry, rgx, rgw, rruns) in zip(got, ref):
        torch.testing.assert_close(y, ry)
        torch.testing.assert_close(gx, rgx)
        torch.testing.assert_close(gw, rgw)
        assert rruns == 2  # stock: forward, then again in the recomputation
    assert [r[3] for r in got[1:]] == [1, 1]  # MUST_SAVE: the forward ran once


def test_must_save_under_auto():
    under_auto = type("Gelu", (Gelu,), {"__module__": "user_models"})
    ref = train(Gelu.apply, None)
    with torch_opaque.auto() as report:
        under_auto.apply(torch.randn(2, requires_grad=True), 1.0)  # defines the op
        name = report.ops[under_auto].split("::")[1]
        got = train(under_auto.apply, policy_for(name))
    assert not report.fallbacks
    for a, b in zip(got, ref):
        for t, r in zip(a[:3], b[:3]):
            torch.testing.assert_close(t, r)


def test_prefer_recompute_reruns_the_forward():
    cls, name = wrapped_copy()

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    got = train(cls.apply, functools.partial(create_selective_checkpoint_contexts, recompute_all))
    ref = train(Gelu.apply, None)
    for a, b in zip(got, ref):
        for t, r in zip(a[:3], b[:3]):
            torch.testing.assert_close(t, r)
    assert [r[3] for r in got[1:]] == [2, 2]


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_must_save_compiled(backend):
    cls, name = wrapped_copy(QuietGelu)
    ref = train(QuietGelu.apply, None)
    got = train(cls.apply, policy_for(name),
                compiled=lambda f: torch.compile(f, backend=backend, fullgraph=True))
    for a, b in zip(got, ref):
        for t, r in zip(a[:3], b[:3]):
            torch.testing.assert_close(t, r)


def test_a_replayed_record_does_not_outlive_the_outputs():
    """The kept record goes with the storage of the outputs it belongs to."""
    import gc
    import weakref

    cls, name = wrapped_copy()
    train(cls.apply, policy_for(name), steps=1)

    class Marker:
        pass

    holder = [Marker()]
    ref = weakref.ref(holder[0])

    class Holds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.marker = holder[0] if holder else None
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    w = torch_opaque.wrap(type("Holds", (Holds,), {}))
    from torch_opaque._impl import function as F

    hname = F.lookup(w).name
    x = torch.randn(3, requires_grad=True)
    for _ in range(2):
        y = checkpoint(lambda a: w.apply(a.sin()), x, use_reentrant=False, context_fn=policy_for(hname))
        y.sum().backward()
    del y
    holder.clear()
    for _ in range(200):  # other tables' entries make the kept records purge theirs
        yy = checkpoint(lambda a: w.apply(a), torch.randn(2, requires_grad=True), use_reentrant=False,
                        context_fn=policy_for("nothing"))
    del yy
    gc.collect()
    assert ref() is None
