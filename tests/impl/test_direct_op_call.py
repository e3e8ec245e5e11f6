"""torch.ops calls of wrapped Functions take a C-level path (Note [Direct op call],
csrc/python/op_call.h).

`torch.ops.opaque.Name.overload(...)` (what ep.module() runs) converts plain
arguments in C and calls the dispatcher; everything torch's own `_op` treats
differently (other Python types, __torch_function__, torch function modes, the
JIT tracer) still goes to torch's `_op`, and everything below the dispatcher
(autograd, modes, fake tensors, vmap, export, compile) sees the op as before.
"""

from typing import Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_opaque
from torch_opaque import _C


class Shift(torch.autograd.Function):
    """A float kept on ctx, an optional tensor, an int and a bool with defaults."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, scale: float, bias: Optional[torch.Tensor] = None, reps: int = 1, neg: bool = False
    ) -> torch.Tensor:
        ctx.scale, ctx.reps, ctx.neg, ctx.has_bias = scale, reps, neg, bias is not None
        y = x * scale * reps
        if bias is not None:
            y = y + bias
        return -y if neg else y

    @staticmethod
    def backward(ctx, g):
        gx = g * ctx.scale * ctx.reps
        gx = -gx if ctx.neg else gx
        gb = (-g if ctx.neg else g) if ctx.has_bias else None
        return gx, None, gb, None, None


Wrapped = torch_opaque.wrap(type("Shift", (Shift,), {}), name="DirectOpShift")


def overload():
    x = torch.randn(3)
    Wrapped.apply(x, 1.0)  # defines the overload
    (ov,) = torch_opaque.lookup(Wrapped).overloads.values()
    return ov.op


def test_the_overload_calls_through_an_op_call_that_keeps_torch_identity():
    op = overload()
    assert isinstance(op._op, _C.OpCall) and op._op.fast
    assert hash(op) == hash(op._op.fallback)  # OpOverload hashes its _op; sets keep working
    assert op in {op} and op._op.__module__ == op._op.fallback.__module__
    assert repr(op._op) == repr(op._op.fallback)


@pytest.mark.parametrize(
    "call",
    [
        lambda op, x, b: op(x, 1.5),
        lambda op, x, b: op(x, 1.5, b),
        lambda op, x, b: op(x, 1.5, None, 3, True),
        lambda op, x, b: op(x, scale=1.5, neg=True, bias=b),
        lambda op, x, b: op(x, 1.5, reps=2),
    ],
)
def test_values_and_gradients_match_the_unwrapped_function(call):
    op = overload()
    x = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    y = call(op, x, b)
    y_ref = call(reference_op, x, b)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn(5)
    got = torch.autograd.grad(y, (x, b), g, allow_unused=True)
    want = torch.autograd.grad(y_ref, (x, b), g, allow_unused=True)
    for a, w in zip(got, want):
        assert (a is None) == (w is None)
        if a is not None:
            torch.testing.assert_close(a, w)


def reference_op(x, scale, bias=None, reps=1, neg=False):
    return Shift.apply(x, scale, bias, reps, neg)


class Recording:
    """A stand-in for torch's `_op` that counts the calls it receives."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.op._op.fallback(*args, **kwargs)


def fallback_calls(fn) -> int:
    op = overload()
    rec = Recording(op)
    qualified, name = op._schema.name, op._schema.overload_name
    fn(_C.OpCall(rec, qualified, name))
    return rec.calls


class Logged(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_arguments_skip_torch_and_the_rest_does_not():
    x = torch.randn(3)
    p = torch.nn.Parameter(torch.randn(3))
    assert fallback_calls(lambda c: c(x, 2.0)) == 0
    assert fallback_calls(lambda c: c(x, 2.0, x, 2, False)) == 0
    assert fallback_calls(lambda c: c(x, scale=2.0, reps=4)) == 0
    assert fallback_calls(lambda c: c(p, 2.0)) == 0  # disabled __torch_function__
    assert fallback_calls(lambda c: c(x, 2)) == 1  # int for float: torch converts it
    assert fallback_calls(lambda c: c(x, 2.0, None, True)) == 1  # bool for int
    assert fallback_calls(lambda c: c(x.as_subclass(Logged), 2.0)) == 1

    def under_mode(c):
        with Mode():
            c(x, 2.0)

    assert fallback_calls(under_mode) == 1
    assert fallback_calls(lambda c: torch.jit.trace(lambda t: c(t, 2.0), x)) >= 1


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        ((1.0, None, 1, False, 7), {}, "expected at most 5 argument"),
        ((1.0,), {"alpha": 2.0}, "Unknown keyword argument 'alpha'"),
        ((), {}, "scale"),
        ((1.0, "bias"), {}, "bias"),
        ((1.0, None, 2**70), {}, "reps"),
    ],
)
def test_bad_calls_raise_torch_own_errors(args, kwargs, fragment):
    op = overload()
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match=fragment) as ours:
        op(x, *args, **kwargs)
    with pytest.raises(RuntimeError) as torch_own:
        op._op.fallback(x, *args, **kwargs)
    assert str(ours.value) == str(torch_own.value)


def test_modes_fake_tensors_and_vmap_see_the_op():
    op = overload()
    x = torch.randn(4, 3)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Log():
        op(x, 2.0)
    assert op in seen
    with FakeTensorMode():
        out = op(torch.empty(7, 2), 2.0)
    assert isinstance(out, FakeTensor) and out.shape == (7, 2)
    torch.testing.assert_close(torch.vmap(lambda t: op(t, 2.0, None, 2))(x), x * 4.0)
    torch.testing.assert_close(
        torch.func.grad(lambda t: op(t, 3.0).sum())(x[0]), torch.full((3,), 3.0)
    )


def test_export_and_compile_keep_the_op():
    op = overload()

    class M(torch.nn.Module):
        def forward(self, t):
            return op(t, 2.0, reps=3)

    x = torch.randn(4)
    ep = torch.export.export(M(), (x,))
    assert op in [n.target for n in ep.graph.nodes]
    torch.testing.assert_close(ep.module()(x), x * 6.0)
    torch.testing.assert_close(torch.compile(M(), backend="aot_eager", fullgraph=True)(x), x * 6.0)
