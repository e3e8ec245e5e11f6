"""PyTorch's own autograd.Function corpus (torch.testing._internal.autograd_function_db)
run through torch_opaque.wrap.

Each entry is checked in three stages, each on a fresh wrapped copy of the entry's
Function class (a subclass, so its first call happens inside that stage; the
original class stays unwrapped and gives the reference results):

- eager:  outputs (and which outputs require grad) equal the original's, twice;
- grad:   torch.autograd.grad of the sum of the differentiable outputs equals
          the original's;
- export: non-strict torch.export.export of a module calling the op holds exactly
          one call of the wrapped op, and ep.module() gives the original's outputs
          and gradients.

EXPECTED maps an entry to "ok" or to {stage: (exception type, message regex)};
stages not listed must work. BUGS marks (entry, stage) pairs where torch_opaque
currently misbehaves: they run as strict xfails of the correct expectation.
See docs/autograd_function_db.md.
"""

import operator
import types

import pytest
import torch
from torch.testing._internal.autograd_function_db import autograd_function_db

import torch_opaque
from torch_opaque import FakeForwardError, SchemaError

NDARRAY = (SchemaError, r"returned a ndarray as output 1; opaque ops return tensors only")
# A numpy forward cannot compute output shapes from fake tensors (no `fake` given).
NUMPY_FAKE = (FakeForwardError, r"cannot run on fake tensors .*\.numpy\(\) is not supported")

EXPECTED = {
    "NumpyCubeAutogradFunction": dict(export=NUMPY_FAKE),
    "NumpyExpMarkDirtyAutogradFunction": dict(export=NUMPY_FAKE),
    "NumpyMulAutogradFunction": dict(export=NUMPY_FAKE),
    "NumpyCubeNotComposableAutogradFunction": dict(eager=NDARRAY, grad=NDARRAY, export=NUMPY_FAKE),
    "NumpySortAutogradFunction": dict(export=NUMPY_FAKE),
    "NumpyTakeAutogradFunction": dict(export=NUMPY_FAKE),
    "SelectAutogradFunction": "ok",
    "CubeGenVmapAutogradFunction": "ok",
    "MulGenVmapAutogradFunction": "ok",
    "SortGenVmapAutogradFunction": "ok",
    "SelectGenVmapAutogradFunction": "ok",
    "ScaleGradGenVmapAutogradFunction": "ok",
    "ZeroGradientsGenVmapAutogradFunction": "ok",
    "ForwardHasDefaultArgsAutogradFunction": "ok",
}

# (entry, stage) -> (reason, the exception the bug raises today); none known.
BUGS: dict = {}

ENTRIES = {e.name: e for e in autograd_function_db}
assert set(ENTRIES) == set(EXPECTED), "autograd_function_db changed: update EXPECTED"


def cases(stage):
    return [
        pytest.param(name, id=name, marks=[pytest.mark.xfail(
            strict=True, reason=BUGS[name, stage][0], raises=BUGS[name, stage][1])]
            if (name, stage) in BUGS else [])
        for name in ENTRIES
    ]


def expectation(name, stage):
    exp = EXPECTED[name]
    return None if exp == "ok" else exp.get(stage)


# ---- helpers --------------------------------------------------------------------

_copies = 0


def wrapped_copy(entry):
    """(wrapped subclass of the entry's Function, callable like entry.op using it)."""
    global _copies
    op = entry.op
    if isinstance(op, types.MethodType):  # Cls.apply, bound when the db was built
        cls, make_call = op.__self__, lambda new: new.apply
    else:  # a lambda calling Cls.apply: rebind the global name to the copy
        (cls,) = [c for n in op.__code__.co_names if isinstance(c := op.__globals__.get(n), type)
                  and issubclass(c, torch.autograd.Function)]
        make_call = lambda new: types.FunctionType(  # noqa: E731
            op.__code__, {**op.__globals__, cls.__name__: new}, op.__name__, op.__defaults__)
    _copies += 1
    qual = f"{cls.__qualname__}_dbcopy{_copies}"
    new = type(cls)(cls.__name__, (cls,), {"__qualname__": qual, "__module__": __name__})
    torch_opaque.wrap(new)
    return new, make_call(new)


def samples(entry):
    """[(args, kwargs)], the same on every call."""
    torch.manual_seed(0)
    return [([s.input, *s.args], s.kwargs)
            for s in entry.sample_inputs("cpu", torch.float32, requires_grad=True)]


def fresh(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            else a for a in args]


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def run(fn, args, kwargs, grad=True):
    """(outputs, grads of the sum of the differentiable outputs w.r.t. the tensor inputs)."""
    args = fresh(args)
    outs = as_tuple(fn(*args, **kwargs))
    if not grad:
        return outs, None
    diff = [o for o in outs if o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(sum(o.sum() for o in diff), inputs, allow_unused=True)
    return outs, grads


def assert_same_outputs(outs, ref):
    assert len(outs) == len(ref)
    assert [o.requires_grad for o in outs] == [r.requires_grad for r in ref]
    torch.testing.assert_close(tuple(o.detach() for o in outs), tuple(r.detach() for r in ref),
                               rtol=0, atol=0)


class CallOp(torch.nn.Module):
    """Calls `fn` with the sample's arguments; its inputs are the tensor arguments."""

    def __init__(self, fn, args, kwargs):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.inputs = tuple(args[i] for i in self.tensor_pos)

    def forward(self, *tensors):
        args = list(self.args)
        for i, t in zip(self.tensor_pos, tensors):
            args[i] = t
        return self.fn(*args, **self.kwargs)


def opaque_calls(ep, cls):
    name = torch_opaque.lookup(cls).name
    return [n for n in ep.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.name == f"opaque::{name}"]


def check_or_raise(name, stage, check):
    err = expectation(name, stage)
    if err is None:
        check()
    else:
        with pytest.raises(err[0], match=err[1]):
            check()


# ---- tests ----------------------------------------------------------------------


@pytest.mark.parametrize("name", cases("eager"))
def test_eager(name):
    entry = ENTRIES[name]
    cls, call = wrapped_copy(entry)
    refs = [(args, kwargs, run(entry.op, args, kwargs, grad=False)[0])
              for args, kwargs in samples(entry)]

    def check():
        for args, kwargs, ref in refs:
            for _ in range(2):  # the first call defines the overload, the second reuses it
                outs, _ = run(call, args, kwargs, grad=False)
                assert_same_outputs(outs, ref)
        assert torch_opaque.lookup(cls).overloads, "the op was not called"

    check_or_raise(name, "eager", check)


@pytest.mark.parametrize("name", cases("grad"))
def test_grad(name):
    entry = ENTRIES[name]
    cls, call = wrapped_copy(entry)
    refs = [(args, kwargs, *run(entry.op, args, kwargs)) for args, kwargs in samples(entry)]

    def check():
        for args, kwargs, ref, ref_grads in refs:
            outs, grads = run(call, args, kwargs)
            assert_same_outputs(outs, ref)
            torch.testing.assert_close(grads, ref_grads, rtol=0, atol=0)
        assert torch_opaque.lookup(cls).overloads, "the op was not called"

    check_or_raise(name, "grad", check)


@pytest.mark.parametrize("name", cases("export"))
def test_export(name):
    entry = ENTRIES[name]
    cls, call = wrapped_copy(entry)
    refs = [(args, kwargs, *run(entry.op, args, kwargs)) for args, kwargs in samples(entry)]

    def check():
        for args, kwargs, ref, ref_grads in refs:
            model = CallOp(call, args, kwargs)
            ep = torch.export.export(model, tuple(t.detach() for t in model.inputs), strict=False)
            assert len(opaque_calls(ep, cls)) == 1, ep.graph
            outs, grads = run(ep.module(), model.inputs, {})
            assert_same_outputs(outs, ref)
            torch.testing.assert_close(grads, ref_grads, rtol=0, atol=0)

    check_or_raise(name, "export", check)


def test_first_call_under_export_adds_only_the_op():
    """Defining the overload inside export (the schema probe) leaves no trace in the graph,
    e.g. no wrap_with_set_grad_enabled node from a grad-mode toggle."""
    entry = ENTRIES["SelectAutogradFunction"]
    cls, call = wrapped_copy(entry)
    ((args, kwargs),) = samples(entry)
    model = CallOp(call, args, kwargs)
    ep = torch.export.export(model, tuple(t.detach() for t in model.inputs), strict=False)
    others = [n.target for n in ep.graph.nodes if n.op == "call_function"
              and n not in opaque_calls(ep, cls) and n.target is not operator.getitem]
    assert others == [], ep.graph
