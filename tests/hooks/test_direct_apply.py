"""Cls.apply's C-level fast path (Note [Direct apply], csrc/python/direct_apply.h).

After a first call, positional calls with the same argument types go straight
from C to the op; everything that Python would treat differently (keywords,
tensors with __torch_function__, torch function modes, subclasses of the class)
must take the Python path and behave exactly as it does.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import torch_opaque


@torch_opaque.op(name="DirectScale")
class DirectScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha=2.0):
        ctx.alpha = alpha
        if alpha < 0:
            raise ValueError("DirectScale: alpha must be >= 0")
        return x * alpha

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.alpha, None


@torch_opaque.op(name="DirectPair")
class DirectPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x.sin(),)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not differentiated in these tests")


def fast(cls):
    return torch_opaque.lookup(cls).direct_apply


def test_repeated_calls_take_the_fast_path_with_equal_results():
    x = torch.randn(5, requires_grad=True)
    y0 = DirectScale.apply(x, 3.0)  # first call: defines the overload, registers the types
    assert fast(DirectScale).size() >= 1
    n = fast(DirectScale).size()
    y1 = DirectScale.apply(x, 3.0)
    assert fast(DirectScale).size() == n  # no new signature for the same types
    torch.testing.assert_close(y0, y1)
    assert y1.grad_fn.name().endswith("DirectScaleBackward")
    (g,) = torch.autograd.grad(y1.sum(), x)
    torch.testing.assert_close(g, torch.full_like(x, 3.0))


def test_single_output_returned_as_a_tuple_stays_a_tuple():
    x = torch.randn(3)
    DirectPair.apply(x)
    out = DirectPair.apply(x)  # fast path
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], x.sin())


def test_keywords_and_defaults_use_the_python_path():
    x = torch.randn(4)
    DirectScale.apply(x, 2.0)
    torch.testing.assert_close(DirectScale.apply(x, alpha=5.0), x * 5.0)
    torch.testing.assert_close(DirectScale.apply(x), x * 2.0)


def test_user_errors_surface_unchanged_on_the_fast_path():
    x = torch.randn(4)
    DirectScale.apply(x, 1.0)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        DirectScale.apply(x, -1.0)


def test_torch_function_mode_sees_the_op():
    x = torch.randn(4)
    DirectScale.apply(x, 2.0)
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        y = DirectScale.apply(x, 2.0)
    torch.testing.assert_close(y, x * 2.0)
    assert torch.ops.opaque.DirectScale.Tensor_float in seen, seen


def test_tensor_subclass_with_torch_function_is_dispatched():
    class Logged(torch.Tensor):
        calls: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.randn(4)
    DirectScale.apply(x, 2.0)
    y = DirectScale.apply(x.as_subclass(Logged), 2.0)
    assert torch.ops.opaque.DirectScale.Tensor_float in Logged.calls
    torch.testing.assert_close(y.as_subclass(torch.Tensor), x * 2.0)


def test_parameters_train_through_apply():
    p = torch.nn.Parameter(torch.randn(3))
    for _ in range(2):  # the second call may take the fast path
        p.grad = None
        DirectScale.apply(p, 4.0).sum().backward()
        torch.testing.assert_close(p.grad, torch.full_like(p, 4.0))


def test_subclass_of_a_wrapped_class_runs_the_original_function():
    class Sub(DirectScale):
        pass

    x = torch.randn(3, requires_grad=True)
    DirectScale.apply(x, 2.0)
    y = Sub.apply(x, 2.0)
    assert "DirectScale" not in y.grad_fn.name()  # plain autograd.Function node
    torch.testing.assert_close(y, x * 2.0)


def test_apply_looks_like_a_method_to_introspection():
    import inspect

    assert str(inspect.signature(DirectScale.apply)) == "(*args, **kwargs)"
    assert DirectScale.apply.__name__ == "apply"
    assert DirectScale.apply.__qualname__ == "DirectScale.apply"
    assert "opaque::DirectScale" in DirectScale.apply.__doc__


def python_apply_calls(fn) -> int:
    """How many times the Python fallback of Cls.apply ran during fn()."""
    import sys

    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "route_apply":
            calls.append(frame)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_known_types_skip_python_and_the_rest_does_not():
    x = torch.randn(3, requires_grad=True)
    p = torch.nn.Parameter(torch.randn(3))
    DirectScale.apply(x, 2.0)
    DirectScale.apply(p, 2.0)
    assert python_apply_calls(lambda: DirectScale.apply(x, 2.0)) == 0
    assert python_apply_calls(lambda: DirectScale.apply(p, 2.0)) == 0  # disabled __torch_function__
    assert python_apply_calls(lambda: DirectScale.apply(x, alpha=2.0)) == 1
    assert python_apply_calls(lambda: DirectScale.apply(x, 2)) == 1  # int: a new signature
    assert python_apply_calls(lambda: DirectScale.apply(x, 2)) == 0  # ... now known

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert python_apply_calls(lambda: DirectScale.apply(x, 2.0)) == 1


@torch_opaque.op(name="DirectNested")
class DirectNested(torch.autograd.Function):
    """Its forward calls its own apply with other argument types."""

    @staticmethod
    def forward(ctx, x, k):
        if k == 0:
            for v in (1.5, True, None, "s", torch.float32, 2):
                DirectNested.apply(x, v)  # new signatures registered mid-call
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def test_apply_may_register_signatures_while_running():
    x = torch.randn(3)
    DirectNested.apply(x, 1)
    out = DirectNested.apply(x, 0)  # fast path; its forward adds six signatures
    torch.testing.assert_close(out, x * 2)
    assert fast(DirectNested).size() == 6  # int, float, bool, None, str, dtype
