"""Functions on jagged NestedTensors run as stock runs them (Note [Ops on wrapper
subclasses] in torch_opaque/integrations/subclasses.py): values, gradients, output
type and offsets equal to the stock Function's, under wrap and auto() (no
fall-back), and the op stays one autograd node."""

import pytest
import torch

import torch_opaque


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class RoundSTE(torch.autograd.Function):
    """Straight-through: autodiff of round() is zero, the custom backward is not."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return (x / scale).round() * scale

    @staticmethod
    def backward(ctx, g):
        return g, None


class SplitGate(torch.autograd.Function):
    """Two outputs, one saved output, a tensor ctx attribute."""

    @staticmethod
    def forward(ctx, x, bias: float = 0.5):
        gate = torch.sigmoid(x + bias)
        ctx.mask = x > 0
        ctx.save_for_backward(gate)
        return x * gate, gate

    @staticmethod
    def backward(ctx, g_out, g_gate):
        (gate,) = ctx.saved_tensors
        return g_out * gate * (1 + ctx.mask) + g_gate * gate * (1 - gate), None


CASES = {
    "cube": (Cube, ()),
    "ste": (RoundSTE, (0.25,)),
    "two_outputs": (SplitGate, ()),
}


def nested(seed):
    torch.manual_seed(seed)
    return torch.nested.nested_tensor(
        [torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)], layout=torch.jagged, requires_grad=True
    )


def run(apply, extra, under_auto=False):
    results = []
    for step in range(3):  # the first eager call is special (Note [First call runs forward once])
        x = nested(step)
        if under_auto:
            with torch_opaque.auto() as report:
                out = apply(x, *extra)
            assert not report.fallbacks, report.fallbacks
            assert report.ops
        else:
            out = apply(x, *extra)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o.values() * (k + 1)).sum() for k, o in enumerate(outs))
        loss.backward()
        results.append(([type(o) for o in outs], [o.offsets() for o in outs],
                        [o.values().detach() for o in outs], x.grad.values()))
    return results


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["wrap", "auto"])
def test_jagged_nested_tensor_matches_stock(case, mode):
    cls, extra = CASES[case]
    copy = type(cls.__name__, (cls,), {"__module__": "user_models"})
    if mode == "wrap":
        copy = torch_opaque.wrap(copy)
    ref = run(cls.apply, extra)
    got = run(copy.apply, extra, under_auto=(mode == "auto"))
    for (types, offsets, values, grad), (rtypes, roffsets, rvalues, rgrad) in zip(got, ref):
        assert types == rtypes
        for a, b in zip(offsets, roffsets):
            assert torch.equal(a, b)
        for a, b in zip(values, rvalues):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(grad, rgrad)


def test_the_op_is_one_node_on_nested_tensors():
    wrapped = torch_opaque.wrap(type("Cube", (Cube,), {"__module__": "user_models"}))
    x = nested(0)
    wrapped.apply(x)
    y = wrapped.apply(x)
    assert type(y.grad_fn).__name__ == "OpaqueBackward"
    assert y.grad_fn.next_functions[0][0].variable is x
    with torch.no_grad():  # the inference op `Name`
        z = wrapped.apply(x)
    torch.testing.assert_close(z.values(), x.values().detach() ** 3)
