"""A tensor the forward keeps as a ctx attribute (not saved), in compiled
training graphs (Note [Eager state is for nodes] in forward_record.h).

The traced `_fwd` returns such tensors among its residuals (the ctx state is
encoded for the graph); the compiled graph's runtime call of `_fwd` must
return the same residuals, not keep the attribute as an object as an eager
call does (it did: "list index out of range" in the compiled forward).
"""

import pytest
import torch

import torch_opaque


class HalfGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        t = torch.tanh(k * x)
        ctx.k = k
        ctx.half = torch.tensor(0.5)  # a tensor attribute made in forward
        ctx.mask = x > 0  # one derived from the input
        ctx.save_for_backward(x, t)
        return ctx.half * x * (1 + t)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        return g * ctx.half * (1 + t + x * ctx.k * (1 - t * t)) * (1 + ctx.mask), None


def model(apply, x):
    return apply(x.sin(), 1.5).cos()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", ["wrap", "auto"])
def test_compiled_training_with_tensor_ctx_attributes_matches_stock(backend, mode):
    cls = type("HalfGelu", (HalfGelu,), {"__module__": "user_models"})
    if mode == "wrap":
        cls = torch_opaque.wrap(cls)
    compiled = torch.compile(lambda x: model(cls.apply, x), backend=backend, fullgraph=True)
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(6, requires_grad=True)
        xs = x.detach().clone().requires_grad_()
        if mode == "auto":
            with torch_opaque.auto() as report:
                out = compiled(x)
            assert not report.fallbacks
        else:
            out = compiled(x)
        out.sum().backward()
        ref = model(HalfGelu.apply, xs)
        ref.sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, xs.grad)
