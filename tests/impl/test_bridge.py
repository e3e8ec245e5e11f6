"""torch_opaque._impl.bridge: what the C++ bridge reads from the runners of
Functions and of stored programs, and the saved-tensor kinds it reports."""

import pytest
import torch

from torch_opaque._impl.bridge import (
    BackwardRunnerProtocol,
    ForwardRunnerProtocol,
    SavedKind,
    saved_triples,
)
from torch_opaque._impl.context import ForwardContext
from torch_opaque._impl.kernels import BackwardRunner, Runner
from torch_opaque._impl.schema import specs_from_values
from torch_opaque.errors import UnsupportedError


def forward(ctx, x, xs):
    mid = x.exp()
    out = mid * 2
    ctx.save_for_backward(None, x, xs[1], out, mid)
    return out


def record_of(fn, args):
    specs = specs_from_values(["x", "xs"], args, {})
    runner = Runner("SavedKinds", fn, None, specs, 1)
    _, residuals, record = runner.run((True, False), args)
    return residuals, record


def test_saved_kinds_are_the_cpp_enum():
    """The forward record's kinds, decoded with SavedKind, say where each saved
    tensor came from: the C++ core and Python agree on the numbers."""
    x = torch.randn(3)
    residuals, record = record_of(forward, (x, [torch.ones(3), torch.zeros(3)]))
    triples = saved_triples(record[0])
    assert [t[0] for t in triples] == [
        SavedKind.NONE, SavedKind.INPUT, SavedKind.INPUT_LIST_ITEM, SavedKind.OUTPUT, SavedKind.RESIDUAL,
    ]  # fmt: skip
    assert triples[1][1] == 0  # argument 0
    assert triples[2][1:] == (1, 1)  # argument 1, item 1
    assert triples[3][1] == 0  # output 0
    assert len(residuals) == 1 and torch.equal(residuals[triples[4][1]], x.exp())


def test_saved_kind_names_match_the_cpp_header():
    import pathlib, re

    header = pathlib.Path(__file__).parents[2] / "include" / "torch_opaque" / "forward_record.h"
    text = header.read_text()
    body = text[text.index("enum class SavedKind") :]
    body = body[: body.index("};")]
    cpp = {re.sub(r"(?<!^)([A-Z])", r"_\1", n).upper(): int(v) for n, v in re.findall(r"(\w+) = (\d+)", body)}
    assert cpp == {k.name: k.value for k in SavedKind}


def test_function_runners_satisfy_the_protocols():
    specs = specs_from_values(["x"], [torch.ones(1)], {})
    assert isinstance(Runner("F", forward, None, specs, 1), ForwardRunnerProtocol)
    assert isinstance(BackwardRunner("F", lambda ctx, g: g, specs), BackwardRunnerProtocol)


def test_modified_input_error_names_the_argument():
    def inplace(ctx, x, xs):
        x.add_(1)
        return x * 2

    with pytest.raises(UnsupportedError, match=r"^torch_opaque: SavedKinds.forward modified its argument 'x' in place"):
        record_of(inplace, (torch.ones(2), [torch.ones(2)]))


def test_gradient_checks():
    specs = specs_from_values(["x", "k"], [torch.ones(1), 2], {})
    runner = BackwardRunner("F", None, specs)
    g = torch.ones(1)
    assert runner.fix_gradient_count((g, None, None)) == (g, None)
    with pytest.raises(RuntimeError, match=r"^torch_opaque: F.backward returned an incorrect number of gradients \(expected 2, got 3\)"):
        runner.fix_gradient_count((g, None, g))
    with pytest.raises(RuntimeError, match=r"^torch_opaque: F.backward returned a gradient different than None at position 2, but the corresponding forward input 'k' is not a Tensor"):
        runner.raise_bad_gradients((g, g))
    with pytest.raises(TypeError, match=r"^torch_opaque: F.backward returned a float at position 1; gradients must be tensors or None"):
        runner.raise_bad_gradients((1.0, None))


def test_forward_outputs_check():
    specs = specs_from_values(["x"], [torch.ones(1)], {})
    runner = Runner("F", forward, None, specs, 2)
    with pytest.raises(RuntimeError, match=r"^torch_opaque: F.forward returned 1 outputs, but its op was defined with 2"):
        runner.outputs(torch.ones(1))
    with pytest.raises(Exception, match=r"^torch_opaque: F.forward returned a int as output 1"):
        runner.outputs((torch.ones(1), 3))
