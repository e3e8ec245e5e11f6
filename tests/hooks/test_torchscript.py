"""torch.jit.script of code calling Cls.apply of wrapped Functions
(Note [TorchScript and wrapped classes]).

Stock TorchScript makes ``Cls.apply`` a Python call node, which runs but
cannot be saved; a wrapped class's call is scripted as its op: values and
the custom backward equal the stock Function's, and the module saves and loads.
"""

import io
import subprocess
import sys
import warnings

import pytest
import torch

import torch_opaque
from torch_opaque import _compat
from torch_opaque.errors import SchemaError, UnsupportedError
from support.processes import child_env


class STE(torch.autograd.Function):
    """A straight-through estimator with a scale, no hints."""

    @staticmethod
    def forward(ctx, x, scale=2.0):
        ctx.scale = scale
        return torch.round(x) * scale

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.scale, None


class AnnotatedClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        inside = (x >= ctx.lo) & (x <= ctx.hi)
        return g * inside + 0.1 * g * ~inside, None, None  # leaky, unlike autograd's clamp


class SinCos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n: int, flag: bool):
        ctx.save_for_backward(x)
        ctx.n = n
        return x.sin() * n, x.cos() if flag else x.cos() * 0

    @staticmethod
    def backward(ctx, ga, gb):
        (x,) = ctx.saved_tensors
        return ga * ctx.n + gb + 1.0, None, None  # not autograd's gradient


class Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return (x * 2,)

    @staticmethod
    def backward(ctx, g):
        return g


def wrapped(cls):
    return torch_opaque.wrap(type(cls.__name__ + "W", (cls,), {}))


def script_module(fn):
    class M(torch.nn.Module):
        def forward(self, x):
            a, b = fn.apply(x * 1.5, 3, True)
            return a + b

    return M


def op_nodes(graph, cls):
    kind = f"opaque::{torch_opaque.lookup(cls).name}"
    return [n for n in graph.nodes() if n.kind() == kind]


def python_calls(graph):
    return [n for n in graph.nodes() if n.kind() == "prim::PythonOp"]


def grads(module, x, *extra):
    x = x.detach().clone().requires_grad_()
    out = module(x, *extra)
    out.sum().backward()
    return out, x.grad


def assert_like(got_module, stock_module, *extra, shape=(3, 4)):
    x = torch.randn(shape)
    want, want_grad = grads(stock_module, x, *extra)
    got, got_grad = grads(got_module, x, *extra)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def roundtrip(scripted):
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    return torch.jit.load(buf)


class STEModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x, 3.0) + self.fn.apply(x)  # the default scale too


def ste_module(fn):
    class M(torch.nn.Module):
        def forward(self, x):
            return fn.apply(x, 3.0) + fn.apply(x)

    return M()


def test_stock_scripts_a_python_call_that_cannot_be_saved():
    """An unwrapped Function, with torch_opaque in use (its TorchScript hook
    installed: on torch 2.15 stock TorchScript scripts no Function call without
    it, test_ctx_properties_are_hidden_from_torchscript)."""
    wrapped(Pair)  # the first wrap installs the hooks
    scripted = torch.jit.script(ste_module(STE))
    assert python_calls(scripted.graph)
    assert_like(scripted, ste_module(STE))
    with pytest.raises(RuntimeError, match="Could not export Python function call"):
        torch.jit.save(scripted, io.BytesIO())


def test_wrapped_class_is_scripted_as_its_op_and_saves():
    W = wrapped(STE)
    W.apply(torch.randn(2), 2.0)  # defines the overload (Tensor, float)
    scripted = torch.jit.script(ste_module(W))
    assert len(op_nodes(scripted.graph, W)) == 2 and not python_calls(scripted.graph)
    assert_like(scripted, ste_module(STE))
    loaded = roundtrip(scripted)
    assert f"ops.opaque.{torch_opaque.lookup(W).name}(" in loaded.code
    assert_like(loaded, ste_module(STE))


def test_annotated_class_needs_no_eager_call():
    W = wrapped(AnnotatedClip)

    @torch.jit.script
    def clip(x: torch.Tensor):
        return W.apply(x, -0.5, 0.5) * 2

    def stock(x):
        return AnnotatedClip.apply(x, -0.5, 0.5) * 2

    assert len(op_nodes(clip.graph, W)) == 1
    assert_like(clip, stock)
    assert_like(roundtrip(clip), stock)


def test_several_outputs_and_int_bool_arguments():
    W = wrapped(SinCos)
    W.apply(torch.randn(2), 1, False)
    scripted = torch.jit.script(script_module(W)())
    assert len(op_nodes(scripted.graph, W)) == 1
    assert_like(scripted, script_module(SinCos)())
    assert_like(roundtrip(scripted), script_module(SinCos)())


F_ALIAS = None


def test_an_alias_of_apply_is_the_op():
    global F_ALIAS
    W = wrapped(STE)
    W.apply(torch.randn(2), 2.0)
    F_ALIAS = W.apply

    def f(x: torch.Tensor):
        return F_ALIAS(x, 0.5)

    scripted = torch.jit.script(f)
    assert len(op_nodes(scripted.graph, W)) == 1
    assert_like(scripted, lambda x: STE.apply(x, 0.5))


def test_no_overload_yet_is_a_clear_error():
    W = wrapped(STE)
    with pytest.raises(SchemaError) as e:
        torch.jit.script(ste_module(W))
    msg = str(e.value)
    assert f"{W.__qualname__} is wrapped as the op opaque::{torch_opaque.lookup(W).name}" in msg
    assert f"Call {W.__qualname__}.apply once eagerly" in msg and "annotate all of forward's arguments" in msg


def test_one_tuple_output_is_refused():
    W = wrapped(Pair)
    W.apply(torch.randn(2))

    def f(x: torch.Tensor):
        return W.apply(x)[0]

    with pytest.raises(UnsupportedError, match=r"returns a 1-tuple.*torch.ops.opaque"):
        torch.jit.script(f)


def test_auto_scripts_the_op():
    class AutoSTE(STE):
        pass

    with torch_opaque.auto(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        AutoSTE.apply(torch.randn(2), 2.0)
        scripted = torch.jit.script(ste_module(AutoSTE))
    assert len(op_nodes(scripted.graph, AutoSTE)) == 2
    assert_like(scripted, ste_module(STE))  # outside auto(): still the op
    assert_like(roundtrip(scripted), ste_module(STE))


def test_auto_keeps_a_python_call_when_no_overload_is_defined():
    class AutoSTE(STE):
        pass

    with torch_opaque.auto(), pytest.warns(UserWarning, match=r"AutoSTE stays a Python call.*once eagerly"):
        scripted = torch.jit.script(ste_module(AutoSTE))
    assert python_calls(scripted.graph) and not op_nodes(scripted.graph, AutoSTE)
    assert_like(scripted, ste_module(STE))


CTX_PROPERTIES_CHILD = """
import torch

class STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)
    @staticmethod
    def backward(ctx, g):
        return g

def script():
    class M(torch.nn.Module):  # a class per call: a failed compile leaves its name taken
        def forward(self, x):
            return STE.apply(x)
    try:
        torch.jit.script(M())
        return "scripted"
    except RuntimeError as e:
        if "Expression of type dots" in str(e):
            return "dots"
        return "c-apply" if "apply of FunctionMeta" in str(e) else repr(e).replace(" ", "_")

before = script()  # stock torch: torch_opaque not imported yet
import torch_opaque
torch_opaque.wrap(type("W", (STE,), {}))  # the hooks are installed (from 2.14 by the import)
print(before, script())
"""


def test_ctx_properties_are_hidden_from_torchscript(tmp_path):
    """Note [ctx properties TorchScript cannot compile]: where FunctionCtx has
    properties (torch 2.15: input_grad_buffers), stock TorchScript cannot script
    a call of an unwrapped Function (nor on 2.14, where apply is a C method it
    does not take: Note [Apply in C]); with torch_opaque's hooks installed it
    can, on every release."""
    ctx = torch.autograd.function.FunctionCtx
    properties = sorted(n for n in dir(ctx) if isinstance(getattr(ctx, n, None), property))
    assert _compat.hide_ctx_properties_from_torchscript() == properties
    assert set(properties) <= set(getattr(ctx, "__jit_unused_properties__", []))
    child = tmp_path / "script_stock.py"  # a file: TorchScript reads the source
    child.write_text(CTX_PROPERTIES_CHILD)
    proc = subprocess.run([sys.executable, str(child)], env=child_env(), capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.split()[-2:]
    from torch_opaque._impl import apply_route as apply_hook

    stock = "dots" if properties else "c-apply" if apply_hook._C_APPLY is not None else "scripted"
    assert (before, after) == (stock, "scripted")
