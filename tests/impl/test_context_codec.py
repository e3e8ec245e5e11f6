"""The ctx-state codec (Note [Context state] in torch_opaque/_impl/context.py):
non-tensor ctx attributes to the `_bwd` op's (state, state_ints) and back."""

import enum
import re

import pytest
import torch

from torch_opaque._impl.context import decode_state, encode_state
from torch_opaque.errors import UnsupportedError


class Mode(enum.IntEnum):
    FAST = 2


def roundtrip(attrs, saved=()):
    saved = list(saved)
    n_before = len(saved)
    state, ints = encode_state("Fn", attrs, saved)
    n_explicit, decoded = decode_state(state, saved, ints)
    assert n_explicit == n_before
    return state, ints, saved, decoded


def test_no_attributes_is_an_empty_state():
    assert encode_state("Fn", {}, []) == ("", [])


@pytest.mark.parametrize(
    "value",
    [
        None, True, 3, -2.5, "text", float("inf"), float("-inf"),
        torch.float16, torch.device("cpu"), torch.Size([2, 3]),
        [1, 2.0, "a"], (1, (2, 3)), [], (),
    ],
)  # fmt: skip
def test_plain_values_come_back_equal_and_of_the_same_type(value):
    *_, decoded = roundtrip({"v": value})
    assert decoded["v"] == value
    assert type(decoded["v"]) is type(value)


def test_nan_comes_back_as_nan():
    *_, decoded = roundtrip({"v": float("nan")})
    assert decoded["v"] != decoded["v"]


def test_number_subclasses_become_plain_values():
    *_, decoded = roundtrip({"mode": Mode.FAST})
    assert decoded["mode"] == 2 and type(decoded["mode"]) is int


def test_tensor_attributes_are_appended_to_the_saved_tensors():
    x, t = torch.ones(2), torch.zeros(3)
    state, ints, saved, decoded = roundtrip({"t": t, "k": 1}, saved=[x])
    assert len(saved) == 2 and saved[1] is t
    assert decoded["t"] is t and decoded["k"] == 1
    assert ints == []


def test_symbolic_ints_go_to_state_ints():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_unbacked_symint()
    state, ints, _, decoded = roundtrip({"rows": s, "shape": (s, 4)})
    assert len(ints) == 2 and all(i is s for i in ints)
    assert decoded["rows"] is s and decoded["shape"] == (s, 4)
    assert "'S'" in state


def test_the_state_is_a_literal_without_code():
    state, *_ = roundtrip({"k": 1, "dt": torch.float32})
    assert state == "(0, (('k', 1), ('dt', ('D', 'float32'))))"


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), r"ctx.v holds a object, which a traced graph cannot carry"),
        ([torch.ones(1)], r"ctx.v holds tensors inside a list"),
    ],
)
def test_values_a_graph_cannot_carry_are_refused_naming_the_attribute(value, message):
    with pytest.raises(UnsupportedError, match=r"^torch_opaque: Fn: " + message):
        encode_state("Fn", {"v": value}, [])


@pytest.mark.parametrize("state, what", [
    ("(0, (('f', ('D', 'ops')),))", "'ops' is not a dtype name"),
    ("(0, (('f', ('D', 'load')),))", "'load' is not a dtype name"),
    ("(0, (('f', ('X', (1, 2))),))", "unknown entry ('X', (1, 2))"),
])
def test_a_crafted_state_decodes_to_plain_values_only(state, what):
    # A program loaded from a file carries its state strings: a dtype tag must
    # name a dtype, not hand any torch attribute (torch.load, torch.ops) to a backward.
    with pytest.raises(UnsupportedError, match=re.escape(what)) as info:
        decode_state(state, [], [])
    assert str(info.value).startswith("torch_opaque: invalid ctx state in the graph")
