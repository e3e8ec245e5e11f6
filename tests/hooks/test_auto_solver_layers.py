"""Data-dependent solver layers (qpth's QPFunction style) under auto() and
wrap with torch.export: never a raw torch error (Note [No raw torch error
from a fall-back] in torch_opaque/_impl/auto_mode.py).

The forward checks its matrix (a solver refuses one that is not positive
definite: stand-in data fails it, so no fake from real runs, Note [Fake from
a real run]) and selects its active set with a boolean mask (a size no fake
tensor knows without data). Compared with the stock Function throughout."""

import warnings

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import torch_opaque
from torch_opaque.errors import FakeForwardError


def make_box_qp(check_in_python: bool):
    """min 1/2 x'Qx + p'x subject to x >= 0, by projected gradient steps.
    `check_in_python`: qpth's own ``if ...: raise`` on the factorisation
    (which stock torch.export cannot trace either); else an async check."""

    class BoxQP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, Q, p):
            _, info = torch.linalg.cholesky_ex(Q)
            if check_in_python:
                if info.any():
                    raise RuntimeError("Q is not SPD.")
            else:
                torch._assert_async(info == 0, "Q is not SPD.")
            x = torch.zeros_like(p)
            step = 1.0 / torch.linalg.matrix_norm(Q, ord=2)
            for _ in range(50):
                x = (x - step * (Q @ x + p)).clamp(min=0)
            idx = (x > 0).nonzero().squeeze(-1)  # the active set
            x = torch.zeros_like(p).index_put((idx,), x[idx])
            ctx.save_for_backward(Q, x)
            return x

        @staticmethod
        def backward(ctx, g):
            Q, x = ctx.saved_tensors
            m = (x > 0).to(g.dtype)
            return None, -m * torch.linalg.solve(Q, g * m)

    return BoxQP


class Layer(torch.nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def forward(self, Q, p):
        return self.cls.apply(Q, p) * 2


def _data():
    return torch.tensor([[2.0, 0.5], [0.5, 1.0]]), torch.tensor([-1.0, 0.3])


def _ours(caught):
    return [str(w.message) for w in caught if "torch_opaque" in str(w.message)]


def test_auto_export_falls_back_with_the_usual_warning():
    Q, p = _data()
    ref = torch.export.export(Layer(make_box_qp(False)), (Q, p)).module()(Q, p)
    cls = make_box_qp(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            ep = torch.export.export(Layer(cls), (Q, p))
    torch.testing.assert_close(ep.module()(Q, p), ref)
    torch.testing.assert_close(ref, Layer(make_box_qp(False))(Q, p))  # eager stock
    assert cls in report.fallbacks and "FakeForwardError" in report.fallbacks[cls]
    warning = _ours(caught)[0]
    assert f"{cls.__qualname__} stays an ordinary autograd.Function (inlined by export)" in warning
    assert "add a `fake` staticmethod" in warning


def test_auto_eager_keeps_the_op_and_matches_stock():
    Q, p = _data()
    stock = make_box_qp(False)
    ref_p = p.clone().requires_grad_()
    ref = stock.apply(Q, ref_p)
    (ref_g,) = torch.autograd.grad(ref.sum(), ref_p)
    cls = make_box_qp(False)
    with torch_opaque.auto() as report:
        p1 = p.clone().requires_grad_()
        y = cls.apply(Q, p1)
    (g,) = torch.autograd.grad(y.sum(), p1)
    assert cls in report.ops
    torch.testing.assert_close((y, g), (ref, ref_g))


def test_wrap_export_is_the_fake_forward_error_naming_fake():
    Q, p = _data()
    cls = torch_opaque.wrap(make_box_qp(False))
    with pytest.raises(FakeForwardError) as info:
        torch.export.export(Layer(cls), (Q, p))
    msg = str(info.value)
    assert "BoxQP.forward cannot run on fake tensors while tracing" in msg
    assert "it also fails on stand-in data (RuntimeError: Q is not SPD.)" in msg
    assert "add a `fake` staticmethod to" in msg


def test_when_stock_fails_too_auto_names_the_fix_not_a_raw_guard_error():
    """qpth 0.0.18 itself: stock torch.export fails on the Python check
    (GuardOnDataDependentSymNode); auto() raises the FakeForwardError that
    names the fix, chained from stock's error, after the usual warning."""
    Q, p = _data()
    with pytest.raises(GuardOnDataDependentSymNode):
        torch.export.export(Layer(make_box_qp(True)), (Q, p))
    cls = make_box_qp(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(FakeForwardError) as info:
            with torch_opaque.auto():
                torch.export.export(Layer(cls), (Q, p))
    msg = str(info.value)
    assert "add a `fake` staticmethod to" in msg
    assert (
        f"torch_opaque.auto() traced {cls.__qualname__} as an ordinary autograd.Function "
        f"instead, which fails under this trace too (GuardOnDataDependentSymNode: Could not "
        f"guard on data-dependent expression" in msg
    )
    assert isinstance(info.value.__cause__, GuardOnDataDependentSymNode)
    assert any("stays an ordinary autograd.Function" in m for m in _ours(caught))


def test_when_stock_fails_eagerly_its_error_is_unchanged():
    bad_Q, p = -torch.eye(2), torch.ones(2)
    with pytest.raises(RuntimeError, match="Q is not SPD.") as stock:
        make_box_qp(True).apply(bad_Q, p)
    with pytest.raises(RuntimeError) as ours:
        with torch_opaque.auto():
            make_box_qp(True).apply(bad_Q, p)
    assert type(ours.value) is type(stock.value) and str(ours.value) == str(stock.value)
