"""The ctx objects of wrapped Functions (Note [ctx types], csrc/python/context_types.h)."""

import pytest
import torch

import torch_opaque
from torch_opaque._impl.context import BackwardContext, ForwardContext
from torch_opaque.errors import UnsupportedError


@torch_opaque.op(name="CtxProbe")
class CtxProbe(torch.autograd.Function):
    seen: dict = {}

    @staticmethod
    def forward(ctx, x, k: int):
        CtxProbe.seen["fwd_dict_before"] = dict(vars(ctx))
        ctx.k = k
        ctx.scale = 0.5
        ctx.save_for_backward(x, None)
        CtxProbe.seen["fwd_dict_after"] = dict(vars(ctx))
        CtxProbe.seen["fwd_saved"] = ctx.saved_tensors
        CtxProbe.seen["fwd_needs"] = ctx.needs_input_grad
        return x * k * 0.5

    @staticmethod
    def backward(ctx, g):
        CtxProbe.seen["bwd_dict"] = dict(vars(ctx))
        x, none = ctx.saved_variables
        CtxProbe.seen["bwd_saved_none"] = none
        CtxProbe.seen["bwd_needs"] = ctx.needs_input_grad
        ctx.extra = 1  # backward may set attributes too
        return g * ctx.k * ctx.scale + 0 * x, None


def test_dict_holds_exactly_the_user_attributes():
    x = torch.randn(3, requires_grad=True)
    CtxProbe.seen.clear()
    CtxProbe.apply(x, 4).sum().backward()
    s = CtxProbe.seen
    assert s["fwd_dict_before"] == {}
    assert s["fwd_dict_after"] == {"k": 4, "scale": 0.5}
    assert s["fwd_saved"][0] is x and s["fwd_saved"][1] is None
    assert s["fwd_needs"] == (True, False)
    assert s["bwd_dict"] == {"k": 4, "scale": 0.5}
    assert s["bwd_saved_none"] is None
    assert s["bwd_needs"] == (True, False)
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_save_for_backward_refuses_non_tensors_with_a_fix():
    @torch_opaque.op(name="SavesAnInt")
    class SavesAnInt(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, 3)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with pytest.raises(
        UnsupportedError,
        match=r"SavesAnInt: save_for_backward can only save tensors or None, but argument 1 "
        r"is a int\. Store other values as ctx attributes \(ctx\.name = value\)\.",
    ):
        SavesAnInt.apply(torch.randn(2, requires_grad=True))


def test_contexts_built_from_python_behave_the_same():
    ctx = ForwardContext("F", (True,))
    t = torch.ones(1)
    ctx.save_for_backward(t)
    ctx.mark_non_differentiable(t)
    ctx.set_materialize_grads(0)
    ctx.note = "x"
    assert ctx.saved_tensors == (t,) and ctx._non_diff == (t,)
    assert ctx._materialize is False and vars(ctx) == {"note": "x"}
    with pytest.raises(UnsupportedError, match=r"F: ctx\.mark_dirty\(\)"):
        ctx.mark_dirty(t)
    b = BackwardContext("F", (t,), (True,), {"note": "x"})
    assert b.saved_tensors == (t,) and b.needs_input_grad == (True,) and b.note == "x"
    assert BackwardContext("F", (), (), None).__dict__ == {}
