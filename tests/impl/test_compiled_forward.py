"""Functions whose forward is ``torch.compile``d, or calls a compiled helper
(transformers' BitNet ``WeightQuant``): torch_opaque runs their bodies for
fakes, probes and traces with Dynamo off (Note [User bodies run without
Dynamo] in torch_opaque/_impl/tracing.py); eager calls keep running the
compiled forward, as stock does.

Running a compiled kernel on fake tensors crashed the process (Inductor's
kernels read the fakes' null data pointers), so every traced case runs in a
child process; the child checks against stock and exits 0."""

import textwrap

import pytest
import torch

import torch_opaque
from support.processes import run_python


# The Functions as transformers writes them (transformers/integrations/bitnet.py),
# and the same with the compiled code in a helper.
FUNCTIONS = '''
import torch


class WeightQuant(torch.autograd.Function):
    @staticmethod
    @torch.compile
    def forward(ctx, weight):
        dtype = weight.dtype
        weight = weight.float()
        scale = 1.0 / weight.abs().mean().clamp_(min=1e-5)
        weight = (weight * scale).round().clamp(-1, 1) / scale
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = grad_output.clone()
        return grad_input


@torch.compile
def _quantize(weight):
    scale = 1.0 / weight.abs().mean().clamp(min=1e-5)
    return (weight * scale).round().clamp(-1, 1) / scale


class WeightQuantHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight):
        return _quantize(weight)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


class BitLinear(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(5, 4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.fn.apply(self.weight)) * 2
'''

_EAGER = {}
exec(FUNCTIONS, _EAGER)  # the same classes in this process, for the eager tests
BitLinear = _EAGER["BitLinear"]

CHILD = '''
import contextlib, sys, warnings
import torch, torch_opaque
from conftest import op_calls

MODE, CLS = sys.argv[1:3]
PATHS = sys.argv[3].split(",")
Stock = globals()[CLS]


def run(model, x):
    w = model.weight
    w.grad = None
    y = model(x)
    y.backward(torch.ones_like(y))
    return y.detach(), w.grad.clone()


x = torch.randn(3, 4)
want_y, want_g = run(BitLinear(Stock), x)  # stock, eager
warnings.filterwarnings("error", message="torch_opaque")  # under auto(): no fall-back
for PATH in PATHS:  # each path with a class of its own (its own op), Dynamo reset
    torch._dynamo.reset()
    Fn = type(CLS, (Stock,), {})
    if MODE == "wrap":
        torch_opaque.wrap(Fn)
    with (torch_opaque.auto() if MODE == "auto" else contextlib.nullcontext()):
        model = BitLinear(Fn)
        if PATH == "export":
            ep = torch.export.export(model, (x,))
            name = torch_opaque.lookup(Fn).name
            assert len(op_calls(ep, name)) == 1, ep.graph
            y, g = run(ep.module(), x)  # the op's custom backward
            torch.testing.assert_close(y, want_y)
            torch.testing.assert_close(g, want_g)
        elif PATH in ("aot_eager", "inductor", "eager_then_aot_eager"):
            if PATH.startswith("eager_then_"):  # the op is defined by an eager call first
                y, g = run(model, x)
                torch.testing.assert_close(y, want_y)
                torch.testing.assert_close(g, want_g)
            y, g = run(torch.compile(model, backend=PATH.replace("eager_then_", "")), x)
            torch.testing.assert_close(y, want_y)
            torch.testing.assert_close(g, want_g)
            assert torch_opaque.lookup(Fn).overloads, "the op was not called"
        elif PATH == "onnx":
            import numpy as np, onnxruntime, torch_opaque.onnx
            proto = torch_opaque.onnx.export(model, (x,))
            name = torch_opaque.lookup(Fn).name
            assert [n.op_type for n in proto.graph.node].count(name) == 1, proto.graph.node
            sess = onnxruntime.InferenceSession(proto.SerializeToString())
            (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
            np.testing.assert_allclose(y, want_y.numpy(), rtol=1e-5, atol=1e-5)
    print("OK", PATH, flush=True)
'''


def _child(mode, cls, paths):
    code = FUNCTIONS + textwrap.dedent(CHILD)
    return run_python(code, args=(mode, cls, ",".join(paths)), with_fixtures=True)


def _fresh(C):
    return type(C.__name__, (C,), {})


@pytest.mark.parametrize("cls", ["WeightQuant", "WeightQuantHelper"])
def test_eager_calls_match_stock(cls):
    Stock = _EAGER[cls]
    W = torch_opaque.wrap(_fresh(Stock))
    x = torch.randn(3, 4)
    a, b = BitLinear(Stock), BitLinear(W)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(b.weight.grad, a.weight.grad)


PATHS = ["export", "aot_eager", "eager_then_aot_eager", "inductor", "onnx"]


@pytest.mark.parametrize("mode", ["wrap", "auto"])
@pytest.mark.parametrize("cls", ["WeightQuant", "WeightQuantHelper"])
def test_traced_compiled_forward_matches_stock(cls, mode):
    # one child process per class and mode, running every path (each with its own op)
    paths = PATHS
    if cls == "WeightQuantHelper" and mode == "auto":  # covered by the wrap case
        paths = [p for p in PATHS if p not in ("inductor", "eager_then_aot_eager")]
    r = _child(mode, cls, paths)
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("OK ")]
    assert r.returncode == 0 and done == paths, (
        f"rc={r.returncode}, paths done: {done}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    )


def test_dynamo_disabled_runs_compiled_functions_eagerly_and_restores_the_stance():
    from torch._dynamo import eval_frame

    from torch_opaque._impl.tracing import dynamo_disabled

    seen = []

    @torch.compile(backend=lambda gm, _: (seen.append(gm), gm.forward)[1])
    def f(x):
        return x + 1

    before = eval_frame._stance
    with dynamo_disabled():
        assert eval_frame._stance.stance == "force_eager"
        f(torch.ones(2))
    assert eval_frame._stance is before
    assert seen == []  # not compiled inside
    f(torch.ones(2))
    assert len(seen) == 1  # compiled outside
