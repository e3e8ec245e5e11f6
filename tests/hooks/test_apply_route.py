"""_impl/apply_route.py: Function.apply rerouted (Note [Apply interception]) leaves
stock Functions as they were: same results, same frames, same tracebacks
(Note [Inlined route check])."""

import inspect
import sys
import traceback

import pytest
import torch

import torch_opaque
from torch_opaque._impl import function as F
from torch_opaque._impl import apply_route as apply_hook


class Depth(torch.autograd.Function):
    """Records how many frames lie between the caller and its forward."""

    frames = None

    @staticmethod
    def forward(ctx, x, marker):
        f, n = sys._getframe(1), 0
        while f is not None and f.f_code is not marker:
            f, n = f.f_back, n + 1
        Depth.frames = n
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise ValueError("forward failed")

    @staticmethod
    def backward(ctx, g):
        return g


def _frames(call) -> int:
    marker = sys._getframe().f_code
    x = torch.ones(2, requires_grad=True)
    out = call(x, marker)
    torch.testing.assert_close(out, x.detach() * 2)
    return Depth.frames


def test_unrouted_apply_adds_no_frame_to_stock():
    F.ensure_routing()
    torch_opaque.wrap(type("RoutedNeighbour", (Depth,), {}))  # something is wrapped
    stock = _frames(lambda x, m: apply_hook.ORIGINAL_APPLY(Depth, x, m))
    rerouted = _frames(lambda x, m: Depth.apply(x, m))
    assert rerouted == stock
    assert Depth.apply(torch.ones(2, requires_grad=True), None).grad_fn.name() == "DepthBackward"


@pytest.mark.skipif(apply_hook._C_APPLY is not None, reason="torch >= 2.14: Function.apply is C code (Note [Apply in C])")
def test_unrouted_apply_tracebacks_point_at_torch_source():
    F.ensure_routing()
    code = torch.autograd.Function.apply.__func__.__code__
    assert code.co_filename == apply_hook.ORIGINAL_APPLY.__code__.co_filename
    try:
        Fails.apply(torch.ones(1))
    except ValueError as e:
        frames = traceback.extract_tb(e.__traceback__)
    apply_frame = next(f for f in frames if f.name == "apply")
    source, first = inspect.getsourcelines(apply_hook.ORIGINAL_APPLY)
    assert apply_frame.filename == code.co_filename
    assert apply_frame.line == source[apply_frame.lineno - first].strip()
    assert "super().apply" in apply_frame.line


def test_inlined_check_refuses_code_it_cannot_read():
    assert apply_hook._inlined_trampoline(compile("x = 1", "<nowhere>", "exec")) is None


ALIAS_CHILD = """
import json, torch
import torch_opaque

class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g

cube = Cube.apply  # bound after the import, before any wrap or auto()

class M(torch.nn.Module):
    def forward(self, x):
        return cube(x)

with torch_opaque.auto() as report:
    ep = torch.export.export(M(), (torch.randn(3),))
print(json.dumps({"ops": len(report.ops), "nodes": [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]}))
"""


def test_an_alias_bound_after_import_is_routed_on_every_release():
    """Note [Aliases bound before routing, where apply is C] (torch_opaque/_compat.py):
    where Function.apply is C code (torch >= 2.14) importing torch_opaque installs
    the route, so an alias bound after the import is an op inside auto(), as on 2.13."""
    from torch_opaque import _compat
    from support.processes import last_json, run_python

    assert _compat.route_apply_on_import() == (apply_hook._C_APPLY is not None)
    out = last_json(run_python(ALIAS_CHILD))
    assert out["ops"] == 1, out
    assert len(out["nodes"]) == 1 and out["nodes"][0].startswith("opaque.Cube_"), out  # one op node, no ATen
