"""torch_opaque._impl.calls: one call-signature type for every Python caller
that receives an op's arguments as PyTorch passes them."""

import inspect

import pytest
import torch

from torch_opaque._impl.calls import CallSignature, bind, full_args, tensor_flags, tensor_kind
from torch_opaque._impl.schema import specs_from_values

SCHEMA = torch._C.parse_schema("ns::f(Tensor x, Tensor? w, int n=3, float s=0.5) -> Tensor")
FWD = torch._C.parse_schema(
    "ns::f_fwd(Tensor x, Tensor? w, int n=3, float s=0.5, bool[]? needs_input_grad=None) "
    "-> (Tensor, Tensor[])"
)


def test_complete_fills_keywords_and_defaults_in_schema_order():
    sig = CallSignature.of_schema(SCHEMA)
    x = torch.ones(2)
    assert sig.complete([x], {"w": None}) == [x, None, 3, 0.5]
    assert sig.complete([x, None], {"s": 2.0}) == [x, None, 3, 2.0]
    assert sig.complete([x, None, 7, 1.0], {}) == [x, None, 7, 1.0]


def test_a_missing_argument_is_an_error_that_names_it():
    sig = CallSignature.of_schema(SCHEMA)
    with pytest.raises(TypeError, match=r"^torch_opaque: ns::f: missing argument 'w'; pass it"):
        sig.complete([torch.ones(2)], {})


def test_too_many_arguments_is_an_error():
    sig = CallSignature.of_schema(SCHEMA)
    with pytest.raises(TypeError, match=r"torch_opaque: ns::f takes 4 arguments \(x, w, n, s\), got 5"):
        sig.complete([torch.ones(2), None, 1, 1.0, 9], {})


def test_the_fwd_schema_has_the_ops_signature():
    """`_fwd`'s needs_input_grad is not one of the op's arguments."""
    assert CallSignature.of_schema(FWD).names == CallSignature.of_schema(SCHEMA).names


@pytest.mark.parametrize(
    "args, kwargs, needs",
    [
        ((1, 2, 3, 4.0, [True, False]), {}, [True, False]),  # by position
        ((1, 2), {"needs_input_grad": [False, True]}, [False, True]),  # by keyword
        ((1, 2), {}, None),  # a call of the op itself
    ],
)
def test_split_needs_input_grad(args, kwargs, needs):
    sig = CallSignature.of_schema(FWD)
    rest, kw, got = sig.split_needs_input_grad(args, kwargs)
    assert got == needs
    assert "needs_input_grad" not in kw
    assert len(rest) <= 4
    assert kwargs == ({"needs_input_grad": needs} if "needs_input_grad" in kwargs else {})  # not mutated


def test_full_args_of_a_fwd_call_drops_needs_input_grad():
    x = torch.ones(2)
    assert full_args(FWD, (x, None), {"needs_input_grad": [True, False]}) == [x, None, 3, 0.5]
    assert full_args(FWD, (x, None, 1, 2.0, [True, False]), {}) == [x, None, 1, 2.0]


def test_of_specs_takes_the_forwards_python_defaults():
    specs = specs_from_values(["x", "k"], [torch.ones(1), 2], {"k": 5})
    sig = CallSignature.of_specs("MyFn", specs)
    assert sig.defaults == {"k": 5}
    assert sig.complete([1], {}) == [1, 5]
    specs = specs_from_values(["x"], [torch.ones(1)], {})
    assert specs[0].default is inspect.Parameter.empty
    with pytest.raises(TypeError, match="torch_opaque: MyFn: missing argument 'x'"):
        CallSignature.of_specs("MyFn", specs).complete([], {})


@pytest.mark.parametrize(
    "decl, kind",
    [
        ("Tensor a", "tensor"),
        ("Tensor? a", "tensor"),
        ("Tensor[] a", "tensors"),
        ("Tensor?[] a", "tensors"),
        ("SymInt a", "value"),
        ("SymInt[] a", "value"),
        ("float? a", "value"),
        ("ScalarType a", "value"),
    ],
)
def test_tensor_kind(decl, kind):
    (arg,) = torch._C.parse_schema(f"ns::g({decl}) -> Tensor").arguments
    assert tensor_kind(arg) == kind


def test_tensor_flags_and_bind():
    assert tensor_flags(SCHEMA) == (True, True, False, False)
    x = torch.ones(1)
    pairs = bind(FWD, (x,), {"w": None, "needs_input_grad": [True]})
    assert [(a.name, v) for a, v in pairs] == [("x", x), ("w", None), ("n", 3), ("s", 0.5)]


BWD = torch._C.parse_schema(  # as csrc/opaque_op.cpp defines `_bwd`
    "ns::f_bwd(Tensor?[] saved, Tensor?[] grads, bool[] needs_input_grad, str state, "
    "SymInt[] state_ints) -> Tensor?[]"
)


def test_the_bwd_schemas_needs_input_grad_is_an_argument_like_the_others():
    # Only `_fwd`'s trailing flags are left out; `_bwd` takes its own as an argument.
    s, g = [torch.zeros(2)], [torch.ones(2)]
    assert CallSignature.of_schema(BWD).names == (
        "saved", "grads", "needs_input_grad", "state", "state_ints")
    assert full_args(BWD, (s, g), {"needs_input_grad": [True], "state": "", "state_ints": []}) == [
        s, g, [True], "", []]
    bound = bind(BWD, (s, g, [False], "st", [3]), {})
    assert [(a.name, v) for a, v in bound][2:] == [
        ("needs_input_grad", [False]), ("state", "st"), ("state_ints", [3])]
