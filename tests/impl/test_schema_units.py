"""torch_opaque._impl.schema, piece by piece: specs from values, from type
hints, return hints and the kinds key (the behaviour through real Functions is
in tests/impl/test_schema_inference.py)."""

import typing
from typing import List, Optional, Sequence, Tuple

import pytest
import torch

from torch_opaque._impl.schema import (
    kinds_key,
    returns_from_hint,
    specs_from_hints,
    specs_from_values,
)
from torch_opaque.errors import SchemaError


@pytest.mark.parametrize(
    "value, decl, token",
    [
        (torch.ones(1), "Tensor a", "Tensor"),
        (None, "Tensor? a", "None"),
        (3, "SymInt a", "int"),
        (True, "bool a", "bool"),
        (0.5, "float a", "float"),
        ("s", "str a", "str"),
        (torch.float16, "ScalarType a", "dtype"),
        (torch.device("cpu"), "Device a", "device"),
        (torch.Size([2, 3]), "SymInt[] a", "size"),
        ([torch.ones(1)], "Tensor[] a", "Tensors"),
        ((torch.ones(1),), "Tensor[] a", "tTensors"),
        ([1, 2], "SymInt[] a", "ints"),
        ((1, 2), "SymInt[] a", "tints"),
        ([True], "bool[] a", "bools"),
        ([1, 2.5], "float[] a", "floats"),
        ([], "SymInt[] a", "ints"),
    ],
)
def test_spec_from_value(value, decl, token):
    (spec,) = specs_from_values(["a"], [value], {})
    assert (spec.decl, spec.token) == (decl, token)


def test_tuples_and_sizes_are_converted_back_for_the_forward():
    t, s = specs_from_values(["t", "s"], [(1, 2), torch.Size([3])], {})
    assert t.convert([1, 2]) == (1, 2)
    assert isinstance(s.convert([3]), torch.Size)


def test_defaults_are_kept_on_the_spec():
    (spec,) = specs_from_values(["k"], [2], {"k": 5})
    assert spec.decl == "SymInt k=5"


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), r"^torch_opaque: f: argument 'a' has type object, which an operator schema cannot carry"),
        ([1, "x"], r"^torch_opaque: f: argument 'a' is a list mixing \['int', 'str'\]"),
        (2**70, r"^torch_opaque: f: argument 'a' is the int 1180591620717411303424, beyond the 64-bit"),
    ],
)
def test_values_no_schema_carries_are_refused(value, message):
    with pytest.raises(SchemaError, match=message):
        specs_from_values(["a"], [value], {}, "f")


def fwd_hinted(ctx, x: torch.Tensor, w: Optional[torch.Tensor], n: int, xs: List[torch.Tensor],
               sizes: Tuple[int, ...], shape: torch.Size, scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    return x


def test_specs_from_hints():
    names = ["x", "w", "n", "xs", "sizes", "shape", "scale"]
    specs = specs_from_hints(fwd_hinted, names, {"scale": 1.0}, "F")
    assert [s.decl for s in specs] == [
        "Tensor x", "Tensor? w", "SymInt n", "Tensor[] xs", "SymInt[] sizes", "SymInt[] shape",
        "float scale=1.0",
    ]  # fmt: skip
    assert specs[4].convert([1, 2]) == (1, 2)


def test_pep604_optional_equals_typing_optional():
    def fwd(ctx, x: torch.Tensor, w: torch.Tensor | None, k: float | None = None, n: None | int = 2):
        return x

    specs = specs_from_hints(fwd, ["x", "w", "k", "n"], {"k": None, "n": 2}, "F")
    assert [s.decl for s in specs] == ["Tensor x", "Tensor? w", "float? k=None", "SymInt? n=2"]


def test_specs_from_hints_needs_every_argument_annotated():
    def fwd(ctx, x: torch.Tensor, k):
        return x

    assert specs_from_hints(fwd, ["x", "k"], {}, "F") is None


def test_an_annotation_no_schema_carries_is_an_error_naming_it():
    def fwd(ctx, x: torch.Tensor, f: dict):
        return x

    with pytest.raises(SchemaError, match=r"^torch_opaque: F: argument 'f' is annotated as <class 'dict'>"):
        specs_from_hints(fwd, ["x", "f"], {}, "F")


def test_optional_of_what_no_schema_carries_falls_back_to_values():
    def fwd(ctx, x: torch.Tensor, cb: Optional[typing.Callable]):
        return x

    assert specs_from_hints(fwd, ["x", "cb"], {}, "F") is None


@pytest.mark.parametrize(
    "hint, expected",
    [
        (torch.Tensor, (1, False)),
        (Tuple[torch.Tensor, torch.Tensor], (2, True)),
        (Tuple[torch.Tensor, ...], None),
        (Sequence[torch.Tensor], None),
        (int, None),
    ],
)
def test_returns_from_hint(hint, expected):
    def fwd(ctx, x):
        return x

    fwd.__annotations__ = {"return": hint}
    assert returns_from_hint(fwd) == expected


def test_kinds_key_tells_apart_what_needs_another_overload():
    t = torch.ones(1)
    assert kinds_key([t, 1]) == kinds_key([t * 2, 5])
    assert kinds_key([t, 1]) != kinds_key([t, 1.0])
    assert kinds_key([[t, t]]) != kinds_key([[t]])
    assert kinds_key([(1, 2)]) != kinds_key([[1, 2]])
