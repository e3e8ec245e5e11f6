"""Forwards that modify an input in place without ctx.mark_dirty (Note [In-place
forwards]): refused with a torch_opaque error before any wrong value can appear,
in eager and in compiled graphs alike."""

import pytest
import torch

import torch_opaque
from torch_opaque.errors import UnsupportedError


def make(name):
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.add_(1)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class UpdatesBuffer(torch.autograd.Function):
        """BatchNorm-like: returns a new tensor but updates a running statistic."""

        @staticmethod
        def forward(ctx, x, running):
            running.mul_(0.9).add_(0.1 * x.mean())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    class ReturnsInputUnchanged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 3

    return {"AddOneInPlace": AddOneInPlace, "UpdatesBuffer": UpdatesBuffer,
            "ReturnsInputUnchanged": ReturnsInputUnchanged}[name]  # fmt: skip


def args_for(name):
    x = torch.randn(3)
    return (x,) if name != "UpdatesBuffer" else (x, torch.zeros(()))


@pytest.mark.parametrize("name, arg", [("AddOneInPlace", "x"), ("UpdatesBuffer", "running")])
def test_in_place_forward_is_refused_on_every_call(name, arg):
    F = torch_opaque.wrap(make(name), name=f"InPlace_{name}")
    text = rf"{F.__qualname__}.forward modified its argument '{arg}' in place"
    for _ in range(2):  # the first call (run from Python) and later ones (the kernel)
        with pytest.raises(UnsupportedError, match=text):
            F.apply(*args_for(name))
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(UnsupportedError, match=text):
        F.apply(x.clone(), *args_for(name)[1:])


@pytest.mark.parametrize("name", ["AddOneInPlace", "UpdatesBuffer"])
def test_in_place_forward_is_refused_when_compiled(name):
    F = torch_opaque.wrap(make(name), name=f"InPlaceCompiled_{name}")
    f = torch.compile(lambda *a: F.apply(*a) * 1, backend="inductor", fullgraph=True)
    with pytest.raises(Exception, match=r"forward modified its argument '\w+' in place"):
        f(*args_for(name))


def test_returning_an_input_unchanged_still_works_as_in_stock():
    Stock = make("ReturnsInputUnchanged")
    F = torch_opaque.wrap(make("ReturnsInputUnchanged"), name="InPlaceIdentity")
    for fn in (Stock.apply, F.apply, F.apply):
        x = torch.randn(3, requires_grad=True)
        y = fn(x)
        y.sum().backward()
        torch.testing.assert_close(y, x.detach())
        torch.testing.assert_close(x.grad, torch.full((3,), 3.0))


def test_in_place_change_of_a_tensor_in_a_list_argument_is_refused():
    class ZeroesFirst(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xs):
            xs[0].zero_()
            return xs[1] * 2

        @staticmethod
        def backward(ctx, g):
            return None

    F = torch_opaque.wrap(ZeroesFirst, name="InPlaceListItem")
    for _ in range(2):
        with pytest.raises(UnsupportedError, match="modified its argument 'xs' in place"):
            F.apply([torch.ones(2), torch.ones(2)])
