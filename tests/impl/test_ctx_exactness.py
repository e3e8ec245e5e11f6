"""ctx values reach the backward exactly as stock autograd.Function delivers them
(Note [Eager context state]); a traced graph encodes them, and says which one it
cannot carry."""

import collections
import enum

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_opaque
from torch_opaque.errors import UnsupportedError


class Mode(enum.IntEnum):
    SUM = 1
    MEAN = 2


Pair = collections.namedtuple("Pair", "lo hi")


class Scale(float):
    pass


class Tag(str):
    pass


class Helper:
    def __init__(self, k):
        self.k = k


def make_values():
    return {
        "np64": np.float64(0.5),
        "np32": np.float32(1.5),
        "npint": np.int64(3),
        "npbool": np.bool_(True),
        "mode": Mode.MEAN,
        "pair": Pair(1, 2),
        "scale": Scale(2.0),
        "tag": Tag("t"),
        "helper": Helper(4),
        "dict": {"a": torch.ones(1), "b": 2},
        "tensors": (torch.ones(1), torch.zeros(1)),
        "lst": [1, 2],
    }


def make_function():
    """The same Function body, once for stock and once to wrap."""
    values = make_values()
    seen = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            for k, v in values.items():
                setattr(ctx, k, v)
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.update({k: getattr(ctx, k) for k in values})
            ctx.calls = getattr(ctx, "calls", 0) + 1  # state kept across retained backwards
            seen["calls"] = ctx.calls
            (x,) = ctx.saved_tensors
            return g * ctx.helper.k * float(ctx.np32)

    return Keep, values, seen


def test_eager_backward_sees_the_very_objects_the_forward_stored():
    Stock, _, stock_seen = make_function()
    Wrapped, values, seen = make_function()
    torch_opaque.wrap(Wrapped, name="KeepExact")
    x = torch.randn(3, requires_grad=True)
    (g_stock,) = torch.autograd.grad(Stock.apply(x).sum(), x)
    (g_wrapped,) = torch.autograd.grad(Wrapped.apply(x).sum(), x)
    torch.testing.assert_close(g_wrapped, g_stock)
    for k, v in values.items():
        assert seen[k] is v, k
        assert type(seen[k]) is type(stock_seen[k]), k


def test_ctx_is_one_object_across_retained_backwards_as_in_stock():
    for wrap in (False, True):
        Fn, _, seen = make_function()
        if wrap:
            torch_opaque.wrap(Fn, name="KeepRetained")
        x = torch.randn(2, requires_grad=True)
        y = Fn.apply(x).sum()
        y.backward(retain_graph=True)
        y.backward()
        assert seen["calls"] == 2, wrap


def plain_function(name, value):
    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.k = value
            return x * 2

        @staticmethod
        def backward(ctx, g):
            Plain.seen = ctx.k
            return g * ctx.k

    return torch_opaque.wrap(Plain, name=name)


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_backward_under_a_dispatch_mode_gets_the_state_encoded():
    # The eager forward kept the objects; a dispatch mode may be tracing the
    # backward, so the node encodes them into `_bwd`'s arguments.
    Fn = plain_function("EncodedK", np.float32(0.5))
    x = torch.randn(3, requires_grad=True)
    y = Fn.apply(x).sum()
    with Passthrough():
        y.backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 0.5))
    assert type(Fn.seen) is float  # a traced graph holds a plain constant


def test_backward_under_a_dispatch_mode_names_an_unencodable_attribute():
    Fn = plain_function("ObjectK", Helper(1))
    y = Fn.apply(torch.randn(3, requires_grad=True)).sum()
    with Passthrough(), pytest.raises(Exception, match=r"ctx\.k holds a Helper, which a traced graph cannot carry"):
        y.backward()


@pytest.mark.parametrize(
    "value, expected",
    [(np.float32(0.25), 0.25), (Mode.MEAN, 2), (Scale(3.0), 3.0), (np.int64(2), 2)],
)
def test_compiled_training_graph_encodes_numbers_as_plain_constants(value, expected):
    Fn = plain_function(f"Num_{type(value).__name__}", value)
    f = torch.compile(Fn.apply, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), float(expected)))


@pytest.mark.parametrize(
    "value, text",
    [
        (Pair(1, 2), r"ctx\.k holds a Pair, which a traced graph cannot carry"),
        ({"a": 1}, r"ctx\.k holds a dict, which a traced graph cannot carry"),
        ((torch.ones(1),), r"ctx\.k holds tensors inside a tuple"),
    ],
)
def test_compiled_training_graph_names_what_it_cannot_carry(value, text):
    Fn = plain_function(f"Bad_{type(value).__name__}", value)
    f = torch.compile(Fn.apply, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=text) as info:
        f(torch.randn(3, requires_grad=True))
    # the error is raised while tracing the forward, as a torch_opaque error
    err = info.value
    while err is not None and not isinstance(err, UnsupportedError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, UnsupportedError)
