"""The first eager call runs the user's forward once, as stock autograd.Function
does (Note [First call runs forward once] in torch_opaque/_impl/opaque_function.py)."""

import textwrap

import numpy as np
import pytest
import torch

import torch_opaque
from support.processes import run_python


def counting_functions(name):
    """Three Function shapes (ctx forward, setup_context, numpy forward), each
    counting its forward calls and drawing random numbers."""
    calls = {"n": 0}

    class Dropoutish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p):
            calls["n"] += 1
            mask = (torch.rand_like(x) > p).to(x.dtype)
            ctx.save_for_backward(mask)
            ctx.p = p
            return x * mask / (1 - p)

        @staticmethod
        def backward(ctx, g):
            (mask,) = ctx.saved_tensors
            return g * mask / (1 - ctx.p), None

    class SetupStyle(torch.autograd.Function):
        @staticmethod
        def forward(x, p):
            calls["n"] += 1
            return x * torch.rand_like(x) * p

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.p = inputs[1]

        @staticmethod
        def backward(ctx, g):
            return g * ctx.p, None

    class NumpyNoise(torch.autograd.Function):
        """Cannot run on fake tensors: numpy and its own RNG."""

        @staticmethod
        def forward(ctx, x, p):
            calls["n"] += 1
            noise = np.random.default_rng(int(torch.randint(0, 1000, ()))).random(x.shape)
            return x * torch.from_numpy(noise).to(x.dtype) * p

        @staticmethod
        def backward(ctx, g):
            return g, None

    return calls, {"Dropoutish": Dropoutish, "SetupStyle": SetupStyle, "NumpyNoise": NumpyNoise}[name]


def run_twice(F, requires_grad):
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=requires_grad)
    ys = [F.apply(x, 0.5), F.apply(x, 0.5)]
    grad = None
    if requires_grad:
        (grad,) = torch.autograd.grad(sum(y.sum() for y in ys), x)
    return ys, grad, torch.rand(2)  # the RNG state after the calls too


@pytest.mark.parametrize("name", ["Dropoutish", "SetupStyle", "NumpyNoise"])
@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("how", ["wrap", "auto"])
def test_first_call_runs_forward_once_with_the_same_random_draws(name, requires_grad, how):
    # (auto() used to learn the outputs from a fake run first, importing Dynamo, then,
    # for NumpyNoise, which cannot run on fake tensors, from a second real run: three
    # forward calls and other random numbers than stock.)
    stock_calls, Stock = counting_functions(name)
    calls, Ours = counting_functions(name)
    ref = run_twice(Stock, requires_grad)
    if how == "wrap":
        torch_opaque.wrap(Ours, name=f"Once_{name}_{requires_grad}")
        got = run_twice(Ours, requires_grad)
    else:
        with torch_opaque.auto() as report:
            got = run_twice(Ours, requires_grad)
        assert Ours in report.ops
    assert calls["n"] == stock_calls["n"] == 2
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])


def test_first_eager_call_under_auto_does_not_import_dynamo():
    code = textwrap.dedent(
        """
        import sys, torch
        import torch_opaque

        class Scale(torch.autograd.Function):  # no type hints: the schema comes from the call
            @staticmethod
            def forward(ctx, x, k):
                ctx.k = k
                return x * k

            @staticmethod
            def backward(ctx, g):
                return g * ctx.k, None

        x = torch.ones(3, requires_grad=True)
        with torch_opaque.auto() as report:
            Scale.apply(x, 2.0).sum().backward()
        assert Scale in report.ops, report
        print(x.grad.tolist(), "torch._dynamo" in sys.modules)
        """
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2.0, 2.0, 2.0] False"


def test_first_call_sees_the_needs_input_grad_of_the_call():
    seen = []

    class Needs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            seen.append(ctx.needs_input_grad)
            ctx.save_for_backward(*(t for t, n in zip((x, y), ctx.needs_input_grad) if n))
            return x * y

        @staticmethod
        def backward(ctx, g):
            return g, g

    torch_opaque.wrap(Needs, name="OnceNeeds")
    x = torch.randn(2, requires_grad=True)
    Needs.apply(x, torch.randn(2))
    assert seen == [(True, False)]


def test_schema_error_is_raised_before_the_forward_runs():
    calls = []

    class TakesObject(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, obj):
            calls.append(1)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    torch_opaque.wrap(TakesObject, name="OnceSchemaError")
    with pytest.raises(torch_opaque.SchemaError, match="argument 'obj' has type object"):
        TakesObject.apply(torch.ones(2), object())
    assert calls == []


def test_first_call_in_inference_mode_and_no_grad():
    for i, mode in enumerate((torch.inference_mode, torch.no_grad)):
        calls, F = counting_functions("Dropoutish")
        torch_opaque.wrap(F, name=f"OnceMode{i}")
        with mode():
            torch.manual_seed(0)
            y = F.apply(torch.ones(4), 0.5)
        torch.manual_seed(0)
        _, Stock = counting_functions("Dropoutish")
        with mode():
            torch.testing.assert_close(y, Stock.apply(torch.ones(4), 0.5))
        assert calls["n"] == 1


def test_forward_reassigned_after_the_first_call_is_not_seen_by_its_overload():
    # Documented (docs/wrap-and-op.md, "The first call"): an overload's meaning is fixed once
    # registered; compiled graphs, exported programs and archives refer to it.
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    torch_opaque.wrap(Twice, name="OnceReassigned")
    x = torch.ones(2)
    torch.testing.assert_close(Twice.apply(x), x * 2)
    Twice.forward = staticmethod(lambda ctx, x: x * 3)
    torch.testing.assert_close(Twice.apply(x), x * 2)
