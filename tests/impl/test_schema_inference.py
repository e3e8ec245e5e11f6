"""Schema inference takes what real forward signatures hold (#9 item 5)."""

import inspect
import typing
import warnings

import pytest
import torch

import torch_opaque
from torch_opaque._impl.schema import ArgSpec, schema_arguments

E = inspect.Parameter.empty


def test_schema_arguments_drops_defaults_a_schema_cannot_state_and_those_before():
    specs = [
        ArgSpec("x", "Tensor", "Tensor"),
        ArgSpec("alpha", "float", "float", default=0.5),
        ArgSpec("dtype", "ScalarType", "dtype", default=torch.float32),
        ArgSpec("n", "SymInt", "int", default=3),
        ArgSpec("mode", "str", "str", default='a "quoted" one'),
        ArgSpec("eps", "float", "float", default=1e-5),
    ]
    assert schema_arguments(specs) == (
        "Tensor x, float alpha, ScalarType dtype, SymInt n, str mode, float eps=1e-05"
    )
    assert schema_arguments(specs[:2] + specs[3:4]) == "Tensor x, float alpha=0.5, SymInt n=3"
    # a None default on an argument inferred as a Tensor, inf, a huge int: not stated
    assert schema_arguments([ArgSpec("w", "Tensor", "Tensor", default=None)]) == "Tensor w"
    assert schema_arguments([ArgSpec("w", "Tensor?", "None", default=None)]) == "Tensor? w=None"
    assert schema_arguments([ArgSpec("f", "float", "float", default=float("inf"))]) == "float f"
    assert schema_arguments([ArgSpec("k", "SymInt", "int", default=2**64)]) == "SymInt k"
    assert schema_arguments([ArgSpec("s", "str", "str", default="a b")]) == 'str s="a b"'


def make(name, forward, n_args):
    def backward(ctx, g):
        return (g * 2,) + (None,) * (n_args - 1)

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    stock = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return torch_opaque.wrap(cls, name=name), stock


def fwd_dtype_after_float(ctx, x, alpha=0.5, dtype=torch.float64, device=torch.device("cpu")):
    return (x * alpha).to(dtype=dtype, device=device)


def fwd_odd_defaults(ctx, x, n=2**40, mode="a b", tag='say "hi"', eps=1e-5):
    return x * 2 + n * eps + len(mode) + len(tag)


def fwd_hinted_optional_callable(ctx, x: torch.Tensor, fn: typing.Optional[typing.Callable] = None) -> torch.Tensor:
    return x * 2 if fn is None else fn(x)


@pytest.mark.parametrize(
    "name, forward, n_args, extra",
    [
        ("DtypeAfterFloat", fwd_dtype_after_float, 4, [(), (0.25,), (0.25, torch.float32)]),
        ("OddDefaults", fwd_odd_defaults, 5, [(), (3,), (3, "xy")]),
        ("OptionalCallable", fwd_hinted_optional_callable, 2, [(), (None,)]),
    ],
)
def test_real_signatures_work_eagerly_like_stock(name, forward, n_args, extra):
    F, Stock = make(name, forward, n_args)
    for more in extra:
        x = torch.randn(3, requires_grad=True)
        y = F.apply(x, *more)
        (g,) = torch.autograd.grad(y.sum(), x)
        y_ref = Stock.apply(x, *more)
        (g_ref,) = torch.autograd.grad(y_ref.sum(), x)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(g, g_ref)
        assert y.dtype == y_ref.dtype


def test_optional_callable_given_a_callable_is_a_clear_error():
    F, _ = make("OptionalCallableGiven", fwd_hinted_optional_callable, 2)
    with pytest.raises(torch_opaque.SchemaError, match="argument 'fn' has type function"):
        F.apply(torch.ones(2), lambda t: t)


def test_int_beyond_int64_is_a_clear_error():
    F, _ = make("HugeInt", fwd_odd_defaults, 5)
    with pytest.raises(torch_opaque.SchemaError, match=r"argument 'n' is the int 18446744073709551616, beyond the 64-bit"):
        F.apply(torch.ones(2), 2**64)


def sparse_forward(ctx, x, y):
    ctx.save_for_backward(x)
    return x.to_dense() * 2 + y


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_arguments_work_eagerly_and_export(layout):
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return None, g * 3

    F = torch_opaque.wrap(
        type("SparseArg", (torch.autograd.Function,), {"forward": staticmethod(sparse_forward), "backward": staticmethod(backward)}),
        name=f"SparseArg_{layout}",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse CSR support is in beta"
        sp = torch.eye(3).to_sparse() if layout == "coo" else torch.eye(3).to_sparse_csr()
        for _ in range(2):
            y = torch.ones(3, requires_grad=True)
            out = F.apply(sp, y)
            out.sum().backward()
            torch.testing.assert_close(out, torch.eye(3) * 2 + 1)
            torch.testing.assert_close(y.grad, torch.full((3,), 9.0))

        class M(torch.nn.Module):
            def forward(self, a, b):
                return F.apply(a, b)

        ep = torch.export.export(M(), (sp, torch.ones(3)))
        torch.testing.assert_close(ep.module()(sp, torch.ones(3)), torch.eye(3) * 2 + 1)
