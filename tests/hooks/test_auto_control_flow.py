"""Exceptions that are control flow pass through auto() untouched
(Note [Control-flow exceptions] in torch_opaque/_impl/auto_mode.py).

Activation checkpointing (torch.utils.checkpoint) around Functions, under
auto() and with wrap, trains exactly as stock does: non-reentrant checkpoint
stops its recomputation by raising from its pack hook, i.e. from inside the
op call, and auto() must neither re-run the call nor fall back. A pack hook's
own error, KeyboardInterrupt and other BaseExceptions propagate unchanged,
with no re-run and no fall-back."""

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torch_opaque
from torch_opaque._impl import auto_state as auto_mod

_counter = iter(range(10**6))


def _kind(x):
    """What the test records of a forward run: a real one, or a probe on fake
    tensors (the first call under a dispatch mode learns the outputs so)."""
    from torch._subclasses.fake_tensor import is_fake

    return "fake" if is_fake(x) else "forward"


def _cube(calls):
    """One saved tensor (the textbook shape)."""

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls.append(_kind(x))
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    return Cube


def _gated_tanh(calls):
    """Several saved tensors and a scalar on ctx, setup_context style, so that
    the early stop of the recomputation happens in the middle of the op's
    saves (written as gated-activation kernels in published packages are)."""

    class GatedTanh(torch.autograd.Function):
        @staticmethod
        def forward(x, gate, scale):
            calls.append(_kind(x))
            t = torch.tanh(x)
            s = torch.sigmoid(gate)
            return t * s * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, gate, scale = inputs
            ctx.save_for_backward(torch.tanh(x), torch.sigmoid(gate), x, gate)
            ctx.scale = scale

        @staticmethod
        def backward(ctx, g):
            t, s, x, gate = ctx.saved_tensors
            gx = g * ctx.scale * s * (1 - t * t)
            ggate = g * ctx.scale * t * s * (1 - s)
            return gx, ggate, None

    return GatedTanh


def _fresh(factory, mode):
    calls = []
    cls = factory(calls)
    cls.__qualname__ = f"{cls.__qualname__}{next(_counter)}"
    cls.__module__ = "user_models.layers"
    if mode == "wrap":
        cls = torch_opaque.wrap(type(cls.__qualname__, (cls,), {}))
    return cls, calls


class _Block(torch.nn.Module):
    def __init__(self, fn_cls, n_in=4):
        super().__init__()
        self.fn_cls = fn_cls
        self.a = torch.nn.Linear(n_in, 6)
        self.b = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 2)

    def inner(self, h):
        """The checkpointed region. The Function's saves are its last ones, so
        non-reentrant checkpoint's early stop is raised from inside the op."""
        h = self.a(h)
        if self.fn_cls.forward.__code__.co_argcount == 3:  # GatedTanh(x, gate, scale)
            return self.fn_cls.apply(h, self.b(h).detach() + h, 0.5)
        return self.fn_cls.apply(h)


def _train(mode, factory, step_fn, steps=3, seed=0):
    """Losses, gradients per step and forward calls of `steps` SGD steps of a
    fresh model whose step is step_fn(model, x); with the warnings raised and
    the auto() report (None for stock and wrap)."""
    cls, calls = _fresh(factory, mode)
    torch.manual_seed(seed)
    model = _Block(cls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4, requires_grad=True)
    losses, grads = [], []
    report = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = torch_opaque.auto() if mode == "auto" else _null()
        with ctx as report:
            for _ in range(steps):
                opt.zero_grad()
                x.grad = None
                loss = model.out(model.b(step_fn(model, x))).square().mean()
                loss.backward()
                losses.append(loss.detach())
                grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
                opt.step()
    return {
        "cls": cls,
        "losses": losses,
        "grads": grads,
        "calls": list(calls),
        "warnings": [str(w.message) for w in caught],
        "report": report,
    }


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_same_as_stock(mode, factory, step_fn):
    stock = _train("stock", factory, step_fn)
    got = _train(mode, factory, step_fn)
    torch.testing.assert_close(got["losses"], stock["losses"], rtol=0, atol=0)
    torch.testing.assert_close(got["grads"], stock["grads"], rtol=0, atol=0)
    # every forward that stock ran (first run and recomputations) ran once, no
    # re-run; a first call under SAC's dispatch mode probes on fake tensors first
    real = [c for c in got["calls"] if c != "fake"]
    assert real == stock["calls"]
    assert got["calls"].count("fake") <= 1
    assert got["warnings"] == stock["warnings"]
    cls = got["cls"]
    if mode == "auto":
        report = got["report"]
        assert report.fallbacks == {}, str(report)
        assert cls in report.ops, str(report)
        assert auto_mod.fallen_back(cls) is None
    else:
        assert torch_opaque.is_wrapped(cls)
    return stock, got


def _ckpt(use_reentrant, **kw):
    def step(model, x):
        return checkpoint(model.inner, x, use_reentrant=use_reentrant, **kw)

    return step


FACTORIES = [pytest.param(_cube, id="one_saved"), pytest.param(_gated_tanh, id="several_saved")]
MODES = ["auto", "wrap"]


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_trains_as_stock(mode, factory, use_reentrant):
    stock, _ = _assert_same_as_stock(mode, factory, _ckpt(use_reentrant))
    # checkpoint really recomputed the forward in backward (2 runs a step)
    assert stock["calls"].count("forward") == 6


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_non_reentrant_checkpoint_with_and_without_early_stop(mode, factory, early_stop):
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is None  # the default: early stop on
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        _assert_same_as_stock(mode, factory, _ckpt(False))


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoints(mode, factory):
    def step(model, x):
        def outer(h):
            h = checkpoint(model.inner, h, use_reentrant=False)
            return checkpoint(model.inner, torch.tanh(h[:, :4]), use_reentrant=False)

        return checkpoint(outer, x, use_reentrant=False)

    _assert_same_as_stock(mode, factory, step)


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("mode", MODES)
def test_selective_activation_checkpoint(mode, factory):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    _assert_same_as_stock(mode, factory, _ckpt(False, context_fn=context_fn))


# ---- errors that are not the op's -------------------------------------------------------


class PackRefused(Exception):
    pass


def _refuse_once():
    """A pack hook that raises the first time only: a re-run as the ordinary
    Function would succeed and hide the error."""
    seen = []

    def pack(t):
        seen.append(t.shape)
        if len(seen) == 1:
            raise PackRefused("this hook refuses the first tensor")
        return t

    return pack, seen


def _raise_from_pack_hook(mode, factory, warm):
    cls, calls = _fresh(factory, mode)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    args = (x,) if factory is _cube else (x, x.flip(0), 0.5)
    pack, seen = _refuse_once()
    ctx = torch_opaque.auto() if mode == "auto" else _null()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ctx as report:
            if warm:
                cls.apply(*args)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with pytest.raises(PackRefused) as info:
                    cls.apply(*args)
            out = cls.apply(*args)  # the next call, without the hook
            out.sum().backward()
    return {
        "error": info.value,
        "calls": calls,
        "pack_calls": len(seen),
        "grad": x.grad,
        "warnings": [str(w.message) for w in caught],
        "report": report,
        "cls": cls,
    }


@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "later_call"])
@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("mode", MODES)
def test_pack_hook_error_propagates_unchanged_without_fall_back(mode, factory, warm):
    stock = _raise_from_pack_hook("stock", factory, warm)
    got = _raise_from_pack_hook(mode, factory, warm)
    assert type(got["error"]) is PackRefused
    assert str(got["error"]) == str(stock["error"]) == "this hook refuses the first tensor"
    assert not getattr(got["error"], "__notes__", None)
    assert got["calls"] == stock["calls"]  # the forward was not run again
    assert got["pack_calls"] == 1  # nor the hook
    assert got["warnings"] == stock["warnings"] == []
    torch.testing.assert_close(got["grad"], stock["grad"])
    if mode == "auto":
        assert got["report"].fallbacks == {}
        assert got["cls"] in got["report"].ops
        assert auto_mod.fallen_back(got["cls"]) is None


class _Stop(BaseException):
    """Not an Exception (as KeyboardInterrupt, SystemExit, GeneratorExit)."""


def _interrupting(where, exc_type):
    calls = []

    class Interrupted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls.append("forward")
            if where == "forward" and calls.count("forward") == 2:
                raise exc_type("stop")
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            calls.append("backward")
            if where == "backward" and calls.count("backward") == 1:
                raise exc_type("stop")
            return g * 2

    Interrupted.__qualname__ = f"Interrupted{next(_counter)}"
    Interrupted.__module__ = "user_models.layers"
    return Interrupted, calls


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, _Stop], ids=["KeyboardInterrupt", "BaseException"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_base_exceptions_pass_through_auto(where, exc_type):
    def run(use_auto):
        cls, calls = _interrupting(where, exc_type)
        x = torch.randn(3, requires_grad=True)
        ctx = torch_opaque.auto() if use_auto else _null()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ctx as report:
                cls.apply(x).sum().backward() if where == "forward" else cls.apply(x)
                with pytest.raises(exc_type) as info:
                    y = cls.apply(x)
                    y.sum().backward()
                cls.apply(x).sum().backward()
        return cls, calls, info.value, report, [str(w.message) for w in caught]

    _, stock_calls, stock_err, _, stock_warn = run(False)
    cls, calls, err, report, warn = run(True)
    assert type(err) is type(stock_err) is exc_type
    assert calls == stock_calls  # no re-run
    assert not getattr(err, "__notes__", None)
    assert warn == stock_warn == []
    assert report.fallbacks == {} and cls in report.ops
    assert auto_mod.fallen_back(cls) is None


def test_a_real_op_failure_still_falls_back():
    """The other side: what the op itself cannot do (a forward that returns a
    Python int next to its tensor; no operator returns one) still falls back,
    with its warning, and then checkpoints as stock."""

    class WithCount(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3, 7

        @staticmethod
        def backward(ctx, g, _):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    WithCount.__module__ = "user_models.layers"
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="WithCount stays an ordinary autograd.Function"):
        with torch_opaque.auto() as report:
            y, n = checkpoint(WithCount.apply, x, use_reentrant=False)
            y.sum().backward()
    assert WithCount in report.fallbacks and n == 7
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
