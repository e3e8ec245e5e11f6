"""Values that contradict their forward's type hints (Note [Hints are advice]
in torch_opaque/_impl/schema.py).

Python does not check annotations, so stock runs norse's
``SuperSpike.forward(ctx, input_tensor: torch.Tensor, alpha: float)`` called
with ``alpha=torch.as_tensor(100.0)``. The hints' schema serves the calls whose
values it carries as they are; others get an overload inferred from their
values, so eager, torch.export and torch.compile (under wrap and under auto())
compute what stock computes, with the custom backward kept; a value no schema
carries at all is a SchemaError on the first call that says what to fix."""

import json
import warnings
from typing import Callable, Optional, Union

import pytest
import torch

import torch_opaque
from conftest import op_calls
from torch._dynamo.testing import CompileCounterWithBackend
from torch_opaque.errors import SchemaError

_counter = iter(range(10**6))


# ---- the Functions, as published packages write them ------------------------------------


class SuperSpike(torch.autograd.Function):
    """norse.torch.functional.threshold.SuperSpike (heaviside forward, the
    SuperSpike surrogate gradient in backward)."""

    @staticmethod
    @torch.jit.ignore
    def forward(ctx, input_tensor: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(input_tensor)
        ctx.alpha = alpha
        return torch.heaviside(input_tensor, torch.as_tensor(0.0).to(input_tensor.device))

    @staticmethod
    @torch.jit.ignore
    def backward(ctx, grad_output):
        (inp,) = ctx.saved_tensors
        alpha = ctx.alpha
        grad_input = grad_output.clone()
        grad = grad_input / (alpha * torch.abs(inp) + 1.0).pow(2)
        return grad, None


class Scale(torch.autograd.Function):
    """An `int` hint for what callers pass as a float factor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class Gain(torch.autograd.Function):
    """A `float` hint (given an int by callers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: float):
        ctx.gain = gain
        return x * gain

    @staticmethod
    def backward(ctx, g):
        return g * ctx.gain, None


class BiasedSquare(torch.autograd.Function):
    """An `Optional[Tensor]` hint, given None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.has_bias = bias is not None
        return x * x + bias if bias is not None else x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g, (g if ctx.has_bias else None)


class Mul(torch.autograd.Function):
    """Two `Tensor` hints; callers pass a Python float as the second."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.y = y
        return x * y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.y, None


class MaybeNegate(torch.autograd.Function):
    """A `bool` hint, given a 0-dim bool tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, negate: bool) -> torch.Tensor:
        ctx.negate = negate
        return torch.where(torch.as_tensor(negate), -x, x) * 2

    @staticmethod
    def backward(ctx, g):
        return torch.where(torch.as_tensor(ctx.negate), -g, g) * 3, None  # custom: not autodiff


# (class, the arguments after x (made inside the model's forward), the overload
#  the call gets: "" = the hints' default, else the one inferred from the values)
CASES = {
    "tensor_for_float": (SuperSpike, lambda: (torch.as_tensor(100.0),), "Tensor_Tensor"),
    "float_for_int": (Scale, lambda: (2.5,), "Tensor_float"),
    "int_for_float": (Gain, lambda: (3,), ""),
    "none_for_optional_tensor": (BiasedSquare, lambda: (None,), ""),
    "float_for_tensor": (Mul, lambda: (1.5,), "Tensor_float"),
    "bool_tensor_for_bool": (MaybeNegate, lambda: (torch.as_tensor(True),), "Tensor_Tensor"),
}


class Model(torch.nn.Module):
    def __init__(self, cls, extra):
        super().__init__()
        self.cls = cls
        self.extra = extra

    def forward(self, x):
        return self.cls.apply(x * 1.0, *self.extra()) + 0.0


def _x():
    return torch.tensor([-1.5, -0.2, 0.0, 0.3, 2.0])


def _fresh(base, mode):
    """A copy of `base` (the class auto() wraps, or wrap's): stock keeps `base`."""
    cls = type(f"{base.__name__}{next(_counter)}", (base,), {})
    cls.__module__ = "user_models.functional"
    return torch_opaque.wrap(cls) if mode == "wrap" else cls


def _stock(base, extra):
    x = _x().requires_grad_()
    out = Model(base, extra)(x)
    (g,) = torch.autograd.grad(out.sum() + (out * out).sum(), x)
    return out.detach(), g


class _Run:
    """Runs a model under the mode ("wrap": nothing around it; "auto": auto())."""

    def __init__(self, mode):
        self.mode = mode
        self.report = None

    def __enter__(self):
        self._ctx = torch_opaque.auto() if self.mode == "auto" else None
        if self._ctx is not None:
            self.report = self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc) if self._ctx is not None else False


def _ours(caught):
    """The warnings torch_opaque gave (torch's own, such as inductor's import
    time deprecations, are no concern here)."""
    return [str(w.message) for w in caught if "torch_opaque" in str(w.message)]


def _grads_of(fn):
    x = _x().requires_grad_()
    out = fn(x)
    (g,) = torch.autograd.grad(out.sum() + (out * out).sum(), x)
    return out.detach(), g


def _check_op(cls, run, overload):
    fn = torch_opaque.lookup(cls)
    assert fn is not None
    assert (overload or "default") in fn.overloads
    if run.report is not None:
        assert run.report.fallbacks == {}, str(run.report)
        assert cls in run.report.ops
    return fn


MODES = ["wrap", "auto"]
IDS = list(CASES)


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("mode", MODES)
def test_eager_matches_stock(mode, case):
    base, extra, overload = CASES[case]
    ref = _stock(base, extra)
    cls = _fresh(base, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Run(mode) as run:
            got = _grads_of(Model(cls, extra))
            again = _grads_of(Model(cls, extra))  # the overload found again
    assert _ours(caught) == []
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    fn = _check_op(cls, run, overload)
    # only the overload these calls use (and, under wrap, the hints' default,
    # registered at decoration when the return is annotated too)
    assert set(fn.overloads) - {"default"} == ({overload} if overload else set())


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("mode", MODES)
def test_export_keeps_the_op_and_its_backward(mode, case):
    base, extra, overload = CASES[case]
    ref = _stock(base, extra)
    cls = _fresh(base, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Run(mode) as run:
            ep = torch.export.export(Model(cls, extra), (_x(),))
    assert _ours(caught) == []
    fn = _check_op(cls, run, overload)
    nodes = op_calls(ep, fn.name)
    assert [n.target._overloadname for n in nodes] == [overload or "default"], ep.graph
    # the exported program's gradients are the custom backward's (stock eager's)
    got = _grads_of(ep.module())
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("mode", MODES)
def test_compile_matches_stock(mode, case, backend):
    base, extra, overload = CASES[case]
    ref = _stock(base, extra)
    cls = _fresh(base, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Run(mode) as run:
            counter = CompileCounterWithBackend(backend)  # records Dynamo's graph, runs `backend`
            compiled = torch.compile(Model(cls, extra), backend=counter, fullgraph=True)
            got = _grads_of(compiled)
    assert _ours(caught) == []
    torch.testing.assert_close(got, ref)
    fn = _check_op(cls, run, overload)
    (graph,) = counter.graphs
    nodes = op_calls(graph, fn.name)
    assert [n.target._overloadname for n in nodes] == [overload or "default"], graph.graph


def test_superspike_surrogate_gradient_is_not_autodiff():
    """What the cases above guard: heaviside's own gradient is zero, so an
    inlined forward (a fall-back) would give zeros where SuperSpike's
    surrogate gives grad / (alpha * |x| + 1)^2."""
    _, g = _stock(SuperSpike, lambda: (torch.as_tensor(100.0),))
    x = _x()
    torch.testing.assert_close(g, (1 + 2 * torch.heaviside(x, torch.tensor(0.0))) / (100 * x.abs() + 1) ** 2)
    assert bool((g != 0).all())


def test_float_for_an_int_hint_is_not_truncated():
    cls = _fresh(Scale, "wrap")
    x = torch.ones(2, requires_grad=True)
    out = cls.apply(x, 2.5)
    out.sum().backward()
    assert out.tolist() == [2.5, 2.5] and x.grad.tolist() == [2.5, 2.5]
    schema = str(torch_opaque.lookup(cls).overloads["Tensor_float"].op._schema)
    assert "float k" in schema


def test_hinted_and_mismatched_calls_keep_their_own_overloads():
    cls = _fresh(SuperSpike, "wrap")
    fn = torch_opaque.lookup(cls)
    assert list(fn.overloads) == ["default"]  # registered at decoration from the hints
    x = _x().requires_grad_()
    for alpha in (100.0, torch.as_tensor(100.0), 100.0, torch.as_tensor(100.0)):
        out = cls.apply(x, alpha)
        (g,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(g, 1 / (100 * x.detach().abs() + 1) ** 2)
    assert sorted(fn.overloads) == ["Tensor_Tensor", "default"]
    assert "float alpha" in str(fn.overloads["default"].op._schema)
    assert "Tensor alpha" in str(fn.overloads["Tensor_Tensor"].op._schema)


class Factor:
    """A user object that stands for a number (no schema carries it)."""

    def __init__(self, v):
        self.v = v

    def __float__(self):
        return float(self.v)


class FactorScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.f = float(factor)
        return x * ctx.f

    @staticmethod
    def backward(ctx, g):
        return g * ctx.f, None


def test_a_value_no_schema_carries_is_a_clear_error_under_wrap():
    cls = _fresh(FactorScale, "wrap")
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(SchemaError) as info:
        cls.apply(x, Factor(2))
    msg = str(info.value)
    assert f"{cls.__qualname__}.forward" in msg
    assert "argument 'factor' is annotated as float" in msg
    assert "this call passes a Factor" in msg
    assert "Pass a float as annotated, or correct the annotation" in msg
    # the annotated kind still works
    cls.apply(x, 2.0).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]


def test_a_value_no_schema_carries_falls_back_under_auto():
    ref = FactorScale.apply(torch.ones(2), Factor(2))
    cls = _fresh(FactorScale, "auto")
    x = torch.ones(2, requires_grad=True)
    with pytest.warns(UserWarning, match="argument 'factor' is annotated as float"):
        with torch_opaque.auto() as report:
            out = cls.apply(x, Factor(2))
    out.sum().backward()
    torch.testing.assert_close(out.detach(), ref)
    assert x.grad.tolist() == [2.0, 2.0]
    assert "annotated as float" in report.fallbacks[cls]


_SPIKE_MODULE = '''
import torch, torch_opaque

@torch_opaque.op
class SuperSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_tensor: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(input_tensor)
        ctx.alpha = alpha
        return torch.heaviside(input_tensor, torch.as_tensor(0.0))

    @staticmethod
    def backward(ctx, grad_output):
        (inp,) = ctx.saved_tensors
        return grad_output / (ctx.alpha * torch.abs(inp) + 1.0).pow(2), None

class Spiking(torch.nn.Module):
    def forward(self, x):
        return SuperSpike.apply(x, torch.as_tensor(100.0))
'''


def test_archive_of_the_overload_from_values_loads_in_a_fresh_process(tmp_path):
    """torch_opaque.load in a process that imports the hinted class (which
    defines the hints' default overload at decoration) defines the saved
    overload from its values, not the hints'."""
    from support.processes import run_python

    (tmp_path / "spiking.py").write_text(_SPIKE_MODULE)
    archive = tmp_path / "spiking.pt2"
    saved = run_python(
        f"""
        import json, torch, torch_opaque, spiking
        ep = torch.export.export(spiking.Spiking(), (torch.randn(5),))
        torch_opaque.save(ep, {str(archive)!r})
        print(json.dumps(sorted(torch_opaque.lookup(spiking.SuperSpike).overloads)))
        """,
        extra_path=[tmp_path],
    )
    assert saved.returncode == 0, saved.stderr
    assert json.loads(saved.stdout) == ["Tensor_Tensor", "default"]
    loaded = run_python(
        f"""
        import json, torch, torch_opaque, spiking
        ep = torch_opaque.load({str(archive)!r})
        x = torch.tensor([-1.5, -0.2, 0.0, 0.3, 2.0], requires_grad=True)
        out = ep.module()(x)
        out.sum().backward()
        print(json.dumps([out.tolist(), x.grad.tolist()]))
        """,
        extra_path=[tmp_path],
    )
    assert loaded.returncode == 0, loaded.stderr
    out, grad = json.loads(loaded.stdout)
    x = _x()
    torch.testing.assert_close(torch.tensor(out), torch.heaviside(x, torch.tensor(0.0)))
    torch.testing.assert_close(torch.tensor(grad), 1 / (100 * x.abs() + 1) ** 2)


# ---- Union hints next to a callable (sinabs' spiking layers) ------------------------------


def _heaviside_surrogate(v_mem, threshold):
    return torch.exp(-((v_mem - threshold) ** 2))


class MultiSpike(torch.autograd.Function):
    """sinabs.activation.spike_generation.MultiSpike, as sinabs writes it: the
    threshold is a float or a tensor, the surrogate gradient a callable."""

    @staticmethod
    def forward(
        ctx,
        v_mem: torch.Tensor,
        spike_threshold: Union[float, torch.Tensor],
        surrogate_grad_fn: Callable,
    ):
        ctx.save_for_backward(v_mem.clone())
        ctx.spike_threshold = spike_threshold
        ctx.surrogate_grad_fn = surrogate_grad_fn
        return torch.div(v_mem, spike_threshold, rounding_mode="trunc").clamp(min=0)

    @staticmethod
    def backward(ctx, grad_output):
        (v_mem,) = ctx.saved_tensors
        return grad_output * ctx.surrogate_grad_fn(v_mem, ctx.spike_threshold), None, None


class ThresholdSpike(torch.autograd.Function):
    """The same threshold hint, without the callable: every value it names has a schema."""

    @staticmethod
    def forward(ctx, v_mem: torch.Tensor, spike_threshold: Union[float, torch.Tensor]):
        ctx.save_for_backward(v_mem)
        ctx.spike_threshold = spike_threshold
        return (v_mem >= spike_threshold).to(v_mem.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (v_mem,) = ctx.saved_tensors
        return grad_output * _heaviside_surrogate(v_mem, ctx.spike_threshold), None


def _spike_grads(cls, *extra):
    x = _x().requires_grad_()
    out = cls.apply(x, *extra)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


@pytest.mark.parametrize("threshold", [torch.tensor(0.25), 0.25], ids=["0dim_tensor", "float"])
@pytest.mark.parametrize("mode", MODES)
def test_union_hint_takes_each_of_its_kinds(mode, threshold):
    ref = _spike_grads(ThresholdSpike, threshold)
    cls = _fresh(ThresholdSpike, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Run(mode) as run:
            got = _spike_grads(cls, threshold)
            ep = torch.export.export(_Apply(cls), (_x(), threshold))
    assert _ours(caught) == []
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    fn = torch_opaque.lookup(cls)
    token = "Tensor_Tensor" if isinstance(threshold, torch.Tensor) else "Tensor_float"
    assert set(fn.overloads) == {token}
    if run.report is not None:
        assert cls in run.report.ops and not run.report.fallbacks
    assert [n.target._overloadname for n in op_calls(ep, fn.name)] == [token]
    torch.testing.assert_close(_grads_of(lambda x: ep.module()(x, threshold))[0], ref[0])


class _Apply(torch.nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def forward(self, x, threshold):
        return self.cls.apply(x, threshold)


def test_union_hint_next_to_a_callable_falls_back_naming_the_callable_under_auto():
    threshold = torch.tensor(0.5)
    ref = _spike_grads(MultiSpike, threshold, _heaviside_surrogate)
    cls = _fresh(MultiSpike, "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_opaque.auto() as report:
            got = _spike_grads(cls, threshold, _heaviside_surrogate)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    (warning,) = _ours(caught)
    assert "argument 'surrogate_grad_fn' has type function, which an operator schema cannot carry" in warning
    assert "spike_threshold" not in warning and "Union" not in warning
    assert "surrogate_grad_fn" in report.fallbacks[cls]


def test_union_hint_next_to_a_callable_is_refused_naming_the_callable_under_wrap():
    cls = _fresh(MultiSpike, "wrap")  # (the Union hint is no schema: nothing refused here)
    with pytest.raises(SchemaError) as info:
        cls.apply(_x(), torch.tensor(0.5), _heaviside_surrogate)
    msg = str(info.value)
    assert "argument 'surrogate_grad_fn' has type function, which an operator schema cannot carry" in msg
    assert "spike_threshold" not in msg and "Union" not in msg


def test_callable_hint_before_a_union_is_refused_when_wrapping():
    class CallableFirst(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v_mem: torch.Tensor, fn: Callable, threshold: Union[float, torch.Tensor]):
            return v_mem * 1

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    with pytest.raises(SchemaError) as info:
        torch_opaque.wrap(CallableFirst)
    msg = str(info.value)
    assert "argument 'fn' is annotated as typing.Callable, which an operator schema cannot carry" in msg
    assert "threshold" not in msg


class UnhintedSurrogate(torch.autograd.Function):
    """Hints on the tensors only: the schema comes from the values."""

    @staticmethod
    def forward(ctx, v_mem: torch.Tensor, spike_threshold: float, surrogate_grad_fn):
        ctx.save_for_backward(v_mem)
        ctx.spike_threshold, ctx.fn = spike_threshold, surrogate_grad_fn
        return (v_mem >= spike_threshold).to(v_mem.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (v_mem,) = ctx.saved_tensors
        return grad_output * ctx.fn(v_mem, ctx.spike_threshold), None, None


class FullyHintedSurrogate(UnhintedSurrogate):
    """Every argument hinted, the callable's hint wrongly (as str): the 0-dim
    tensor passed for the float hint is not the argument refused."""

    @staticmethod
    def forward(ctx, v_mem: torch.Tensor, spike_threshold: float, surrogate_grad_fn: str):
        return UnhintedSurrogate.forward(ctx, v_mem, spike_threshold, surrogate_grad_fn)


@pytest.mark.parametrize("base", [UnhintedSurrogate, FullyHintedSurrogate])
def test_refusal_names_the_argument_no_schema_carries(base):
    threshold = torch.tensor(0.5)
    ref = _spike_grads(base, threshold, _heaviside_surrogate)
    cls = _fresh(base, "wrap")
    with pytest.raises(SchemaError) as info:
        cls.apply(_x(), threshold, _heaviside_surrogate)
    msg = str(info.value)
    assert "argument 'surrogate_grad_fn'" in msg and "spike_threshold" not in msg
    assert "function" in msg
    cls = _fresh(base, "auto")
    with pytest.warns(UserWarning, match="argument 'surrogate_grad_fn'"):
        with torch_opaque.auto() as report:
            got = _spike_grads(cls, threshold, _heaviside_surrogate)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert "spike_threshold" not in report.fallbacks[cls]
