"""Which stored kind of call serves a call of an op re-created from a
self-contained archive (torch_opaque/archive/stored.py): the variant records'
argument descriptions matched against the call's values."""

import pytest
import torch

from torch_opaque._impl.bridge import SavedKind
from torch_opaque.archive.manifest import ArgRecord, OpEntry, OverloadRecord, SavedRecord, TensorSig, VariantRecord
from torch_opaque.archive.stored import StoredOverload, _Variant
from torch_opaque.archive.values import encode_value

SCHEMA = torch._C.parse_schema(
    "ns::F(Tensor x, float s, SymInt n, Tensor? w, Tensor[] xs) -> Tensor"
)


def variant(vid=0, x_shape=(None, 3), dtype="float32", s=2.0, w="none", n_items=2):
    args = [
        ArgRecord("tensor", tensor=TensorSig(dtype, list(x_shape), "cpu")),
        ArgRecord("const", value=encode_value(s)),
        ArgRecord("dyn"),
        ArgRecord(w, tensor=TensorSig("float32", [3], "cpu")) if w == "tensor" else ArgRecord("none"),
        ArgRecord("tensors", items=[TensorSig("float32", [2], "cpu")] * n_items),
    ]
    record = VariantRecord(
        id=vid, args=args, n_residuals=0, n_state_ints=0,
        saved=[SavedRecord("input", 0, 0), SavedRecord("none"), SavedRecord("input_item", 4, 1)],
        non_differentiable=[False], grads=[0], fwd="", bwd="",
    )  # fmt: skip
    return _Variant(record, {}, SCHEMA)


def call(x=None, s=2.0, n=5, w=None, xs=None):
    x = torch.randn(7, 3) if x is None else x
    xs = [torch.ones(2), torch.zeros(2)] if xs is None else xs
    return [x, s, n, w, xs]


def test_a_matching_call_gives_the_flat_program_inputs():
    args = call()
    flat = variant().match(args, fake=False)
    assert flat is not None
    assert flat[0] is args[0] and flat[1] is args[4][0] and flat[2] is args[4][1] and flat[3] == 5


@pytest.mark.parametrize(
    "args, why",
    [
        (call(x=torch.randn(7, 4)), "a static size differs"),
        (call(x=torch.randn(7, 3, 1)), "another rank"),
        (call(x=torch.randn(7, 3, dtype=torch.float64)), "another dtype"),
        (call(s=3.0), "another constant"),
        (call(w=torch.ones(3)), "a tensor where None was stored"),
        (call(xs=[torch.ones(2)]), "another number of list items"),
        (call(n="five"), "not an int where an int was stored"),
        (call()[:4], "another number of arguments"),
    ],
)
def test_a_call_outside_the_variant_is_not_matched(args, why):
    assert variant().match(args, fake=False) is None, why


def test_symbolic_dimensions_match_any_size():
    assert variant(x_shape=(None, 3)).match(call(x=torch.randn(1, 3)), fake=False) is not None
    assert variant(x_shape=(7, 3)).match(call(x=torch.randn(8, 3)), fake=False) is None


def test_fake_calls_match_on_dtype_and_rank_only():
    """While tracing, sizes may be symbolic: only dtype and rank are compared."""
    assert variant(x_shape=(7, 3)).match(call(x=torch.randn(8, 3)), fake=True) is not None
    assert variant(x_shape=(7, 3)).match(call(x=torch.randn(8, 3, dtype=torch.float64)), fake=True) is None


def test_an_int_constant_matches_the_equal_float():
    """A float argument's value is compared as the kernel receives it."""
    assert variant(s=2.0).match(call(s=2), fake=False) is not None


def test_saved_records_decode_to_the_cpp_kinds():
    assert variant().saved == [SavedKind.INPUT, 0, 0, SavedKind.NONE, 0, 0, SavedKind.INPUT_LIST_ITEM, 4, 1]


def overload(variants):
    op = OpEntry("ns", "F", "pkg.mod", "F", "python", [])
    return StoredOverload(op, OverloadRecord("Tensor", str(SCHEMA), "", 1), "Tensor_stored_x", SCHEMA, variants)


def test_select_takes_the_first_matching_variant():
    sov = overload([variant(0, dtype="float64"), variant(1), variant(2)])
    v, _ = sov.select(call(), fake=False)
    assert v.id == 1


def test_an_uncovered_call_is_an_error_listing_what_is_covered():
    sov = overload([variant(0), variant(1, s=0.5, x_shape=(2, 3))])
    with pytest.raises(RuntimeError) as e:
        sov.select(call(s=1.0), fake=False)
    msg = str(e.value)
    assert msg.startswith("torch_opaque: ns::F.Tensor was re-created from the stored programs")
    assert "(x: float32[*, 3], s=2.0, n: any int, w=None, xs: 2 tensors)" in msg
    assert "(x: float32[2, 3], s=0.5, n: any int, w=None, xs: 2 tensors)" in msg
    assert "this call (x: float32[7, 3], s=1.0, n=5, w=None" in msg
    assert "Load the archive with allow=[<defining module>]" in msg


def test_stored_runners_satisfy_the_bridge_protocols_with_the_same_errors():
    """The C++ bridge reads the same attributes from a stored overload's runners
    as from a Function's, and their error paths say the same things."""
    from torch_opaque._impl.bridge import BackwardRunnerProtocol, ForwardRunnerProtocol
    from torch_opaque.archive.stored import _StoredBackwardRunner, _StoredRunner

    sov = overload([variant()])
    fwd, bwd = _StoredRunner(sov), _StoredBackwardRunner(sov)
    assert isinstance(fwd, ForwardRunnerProtocol) and isinstance(bwd, BackwardRunnerProtocol)
    assert bwd.tensor_flags == (True, False, False, True, False)
    g = torch.ones(1)
    with pytest.raises(RuntimeError, match=r"^torch_opaque: ns::F.Tensor.backward returned an incorrect number of gradients \(expected 5, got 6\)"):
        bwd.fix_gradient_count((g,) * 6)
    with pytest.raises(RuntimeError, match=r"at position 2, but the corresponding forward input 's' is not a Tensor"):
        bwd.raise_bad_gradients((None, g, None, None, None))
    with pytest.raises(Exception, match=r"^torch_opaque: ns::F.Tensor.forward modified its argument 'n' in place"):
        fwd.raise_modified_input(2)
    with pytest.raises(RuntimeError, match=r"^torch_opaque: ns::F.Tensor.forward returned 2 outputs"):
        fwd.outputs((g, g))
