"""torch_opaque._impl.tracing: sizes for symbolic dimensions, real-shaped
stand-ins, copies of outputs that alias inputs, and tracing one kind of call
to ATen."""

import torch
import torch_opaque
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from torch_opaque._impl.bridge import SavedKind, saved_triples
import pytest

from torch_opaque._impl.function import lookup
from torch_opaque._impl.kernels import BackwardRunner
from torch_opaque._impl.tracing import (
    FALLBACK_SIZE_HINT,
    BackwardTrace,
    CallTemplate,
    ForwardTrace,
    real_shaped,
    size_hint,
    trace_to_aten,
    unalias,
)


def test_size_hint_of_ints_and_backed_symbols():
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, source=ConstantSource("s")), hint=6)
    assert size_hint(5) == 5
    assert size_hint(s) == 6
    assert size_hint(s * 2 + 1) == 13


def test_size_hint_of_an_unbacked_symbol_respects_its_range():
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    assert size_hint(u) >= 2
    torch._check(u >= 9)
    assert size_hint(u) >= 9
    assert FALLBACK_SIZE_HINT not in (0, 1)


def test_real_shaped_replaces_symbols_everywhere():
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(3, source=ConstantSource("s")), hint=3)
    assert real_shaped(s) == 3 and type(real_shaped(s)) is int
    assert real_shaped(torch.Size([2])) == torch.Size([2])
    assert real_shaped([1, (s, 2)]) == [1, (3, 2)]
    t = real_shaped(torch.empty(4, 2).t())
    assert t.shape == (2, 4) and t.stride() == (1, 2)
    assert real_shaped("x") == "x"


def test_unalias_copies_outputs_sharing_storage_with_inputs_or_earlier_outputs():
    x = torch.randn(4, 3)
    a, b, c, d = x[:2], x.exp(), x, None
    e = b.view(-1)
    outs = unalias((a, b, c, d, e), [x])
    assert outs[1] is b and outs[3] is None
    for k in (0, 2, 4):
        assert not torch._C._is_alias_of(outs[k], x) and not torch._C._is_alias_of(outs[k], b)
    torch.testing.assert_close(outs[0], a)
    torch.testing.assert_close(outs[4], e)
    same = (x.exp(),)
    assert unalias(same, [x])[0] is same[0]


class ScaledSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float, extra):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.sin() * scale + sum(extra)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos() * ctx.scale, None, None


StockScaledSin = type("StockScaledSin", (torch.autograd.Function,), dict(ScaledSin.__dict__))
torch_opaque.wrap(ScaledSin, name="TraceScaledSin")


def _traced_call(needs=None, report=None, tail=()):
    """ScaledSin's forward for calls (tensor, 2.0, [tensor, tensor]) as an ATen program."""
    x, extra = torch.randn(5, 3), [torch.randn(5, 3), torch.randn(5, 3)]
    ScaledSin.apply(x, 2.0, extra)
    (ov,) = lookup(ScaledSin).overloads.values()
    slots = [("T",), ("C", 2.0), ("L", 2), *tail]
    module = ForwardTrace(ov.runner, CallTemplate(slots), needs=needs, report=report,
                          state_ints=report is not None)
    dim = torch.export.Dim("n")
    return trace_to_aten(module, [x, *extra], [{0: dim}, {0: dim}, {0: dim}])


def test_forward_trace_of_a_call_kind_is_an_aten_program_with_stock_values():
    prog = _traced_call()
    targets = {n.target for n in prog.graph.nodes if n.op == "call_function"}
    assert targets and all(t.namespace == "aten" for t in targets), targets
    y, e = torch.randn(7, 3), [torch.randn(7, 3), torch.randn(7, 3)]
    (got,) = prog.module()([y, *e])
    torch.testing.assert_close(got, StockScaledSin.apply(y, 2.0, e))


def test_forward_trace_records_with_the_given_or_the_calls_own_needs_input_grad():
    unrecorded = []
    _traced_call(report=unrecorded.append)
    assert unrecorded == []  # needs None: not recorded, as the inference op
    given, own = [], []
    _traced_call(needs=(True, False, False), report=given.append)
    # a Name_fwd call carries its needs_input_grad as its last argument
    _traced_call(report=own.append, tail=[("C", [True, False, False])])
    saved, _non_diff, _materialize, state, _ints = given[-1]
    assert saved_triples(saved) == [(SavedKind.INPUT, 0, 0)]  # x, the first argument
    assert state  # ctx.scale
    assert own[-1][0] == saved and own[-1][3] == state


def test_call_template_rebuilds_lists_of_symbolic_ints():
    a = torch.ones(1)
    t = CallTemplate([("T",), ("IL", 2), ("I",), ("C", "s")])
    assert t.rebuild([a, 3, 4, 5]) == [a, [3, 4], 5, "s"]


def _backward_of_a_recorded_call():
    """(backward callable, state, x) of one recorded ScaledSin call."""
    records = []
    _traced_call(needs=(True, False, False), report=records.append)
    _saved, _nd, _m, state, ints = records[-1]
    fn = lookup(ScaledSin)
    (ov,) = fn.overloads.values()
    runner = BackwardRunner(fn.display_name, ScaledSin.backward, ov.specs)
    return (lambda *a: runner(*a)[0]), state, list(ints)


def test_backward_trace_is_an_aten_program_with_stock_gradients():
    backward, state, ints = _backward_of_a_recorded_call()
    template = CallTemplate([("O", (False,)), ("L", 1), ("C", [True, False, False]),
                             ("C", state), ("IL", len(ints))])
    reported = []
    module = BackwardTrace(backward, template, report=reported.append)
    x, g = torch.randn(5, 3), torch.randn(5, 3)
    dim = torch.export.Dim("n")
    prog = trace_to_aten(module, [x, g, *ints], [{0: dim}, {0: dim}, *([None] * len(ints))])
    assert reported == [(0,)]  # only x gets a gradient
    targets = {n.target for n in prog.graph.nodes if n.op == "call_function"}
    assert targets and all(t.namespace == "aten" for t in targets), targets

    y = torch.randn(8, 3, requires_grad=True)
    gy = torch.randn(8, 3)
    extra = [torch.randn(8, 3), torch.randn(8, 3)]
    (want,) = torch.autograd.grad(StockScaledSin.apply(y, 2.0, extra), y, gy)
    (got,) = prog.module()([y.detach(), gy, *ints])
    torch.testing.assert_close(got, want)


def test_backward_trace_refuses_a_none_gradient_the_program_needs():
    backward, state, ints = _backward_of_a_recorded_call()
    template = CallTemplate([("O", (False,)), ("L", 1), ("C", [True, False, False]),
                             ("C", state), ("C", ints)])
    module = BackwardTrace(backward, template, positions=(0, 1))
    with pytest.raises(RuntimeError, match=r"returned None for argument\(s\) \[1\]"):
        module([torch.randn(2, 3), torch.randn(2, 3)])
