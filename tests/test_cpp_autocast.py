"""A C++ op follows the autocast state it was called under, in eager code,
torch.export (``ep.module()``, ``run_decompositions``), torch.compile
(aot_eager, inductor) and archives (Note [Autocast in the call: C++ ops] in
csrc/autocast_variant.cpp): values, dtypes and gradients equal those of the
same math as a stock autograd.Function called eagerly under autocast.

The ops are tests/cpp/autocast_test_ops.cpp's: opaque_autocast_test::matmul
(``x @ w``) and scaled_matmul (``(x @ w) * scale``, with a fake)."""


import pytest
import torch

import torch_opaque
from support.autocast_steps import assert_same, step
from support.build_tree import TEST_LIBS, missing
from support.processes import last_json, run_python

LIB = TEST_LIBS / "libautocast_test_ops.so"
AUTOCAST = "cpu:torch.bfloat16"


@pytest.fixture(scope="module", autouse=True)
def ops():
    assert LIB.exists(), missing(LIB)
    torch_opaque.load_library(LIB)
    return torch.ops.opaque_autocast_test


class StockMatMul(torch.autograd.Function):  # the C++ ops' math, as stock PyTorch runs it
    @staticmethod
    def forward(ctx, x, w, scale=None):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        y = x @ w
        return y if scale is None else y * scale

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if ctx.scale is not None:
            g = g * ctx.scale
        gx, gw = g @ w.t().to(g.dtype), (x.t().to(g.dtype) @ g).to(w.dtype)
        return (gx, gw) if ctx.scale is None else (gx, gw, None)


class Net(torch.nn.Module):
    def __init__(self, call, scaled=False, inside=True):
        super().__init__()
        torch.manual_seed(0)
        self.call_op, self.scaled, self.inside = call, scaled, inside
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def body(self, x):
        h = torch.nn.functional.linear(x, torch.eye(3))  # autocast: bfloat16 from here on
        if self.scaled:
            return self.call_op(h, self.w, 0.5) + 1
        return self.call_op(h, self.w) + 1

    def forward(self, x):
        if self.inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.body(x)
        return self.body(x)


def nets(ops, scaled, inside=True):
    op = ops.scaled_matmul if scaled else ops.matmul
    return Net(StockMatMul.apply, scaled, inside), Net(op, scaled, inside)


def opaque_targets(gm):
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("opaque_autocast_test.")]


SCALED = pytest.mark.parametrize("scaled", [False, True], ids=["matmul", "scaled_matmul_with_fake"])


def test_the_variant_family_exists_with_the_state_last(ops):
    assert str(ops.matmul_autocast.default._schema) == (
        'opaque_autocast_test::matmul_autocast(Tensor x, Tensor w, str autocast_state="") -> Tensor'
    )
    assert hasattr(ops, "matmul_autocast_fwd") and hasattr(ops, "matmul_autocast_bwd")
    key = torch._C.DispatchKey.AutocastCPU
    assert torch._C._dispatch_has_kernel_for_dispatch_key("opaque_autocast_test::matmul", key)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("opaque_autocast_test::matmul_autocast", key)


@SCALED
def test_eager_and_export_follow_autocast_as_stock(ops, scaled):
    x = torch.randn(2, 3)
    stock, net = nets(ops, scaled)
    want = step(stock, x)
    assert want[0].dtype == torch.bfloat16
    assert_same(step(net, x), want)
    ep = torch.export.export(net, (x,), strict=False)
    assert_same(step(net, x, ep.module()), want)
    decomposed = ep.run_decompositions()
    name = "scaled_matmul" if scaled else "matmul"
    # one opaque node, the variant, with the autocast state in its arguments
    assert opaque_targets(decomposed.graph_module) == [f"opaque_autocast_test.{name}_autocast.default"]
    (node,) = [n for n in decomposed.graph.nodes if "_autocast" in str(n.target)]
    assert node.args[-1] == AUTOCAST
    assert_same(step(net, x, decomposed.module()), want)


@pytest.mark.parametrize("inside", [True, False], ids=["autocast_inside", "autocast_around"])
def test_aot_eager_follows_autocast_as_stock(ops, inside):
    x = torch.randn(2, 3)
    stock, net = nets(ops, False, inside)
    want = step(stock, x)
    graphs = []

    def backend(gm, example_inputs):
        def compiler(g, _):
            graphs.append(g)
            return g

        from functorch.compile import make_boxed_compiler
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=make_boxed_compiler(compiler),
                            bw_compiler=make_boxed_compiler(compiler))(gm, example_inputs)

    assert_same(step(net, x, torch.compile(net, backend=backend, fullgraph=True)), want)
    fwd = opaque_targets(graphs[0])
    assert fwd == ["opaque_autocast_test.matmul_autocast_fwd.default"], fwd


@SCALED
def test_inductor_follows_autocast_as_stock(ops, scaled):
    x = torch.randn(2, 3)
    stock, net = nets(ops, scaled)
    want = step(stock, x)
    assert_same(step(net, x, torch.compile(net, backend="inductor", fullgraph=True)), want)


def test_no_autocast_keeps_the_plain_op(ops):
    _, net = nets(ops, False, inside=False)
    ep = torch.export.export(net, (torch.randn(2, 3),), strict=False)
    assert opaque_targets(ep.run_decompositions().graph_module) == [
        "opaque_autocast_test.matmul.default"]
    assert net(torch.randn(2, 3)).dtype == torch.float32


def test_a_state_that_is_not_one_is_refused(ops):
    with pytest.raises(RuntimeError, match=r"opaque_autocast_test::matmul_autocast: autocast state "
                       r"'cpu:torch.notatype' is not '<device type>:<dtype>' of a device autocast knows"):
        ops.matmul_autocast(torch.randn(2, 3), torch.randn(3, 4), "cpu:torch.notatype")


@pytest.mark.parametrize("self_contained", [False, True], ids=["with_the_library", "self_contained"])
def test_archive_of_a_program_calling_the_variant_loads(ops, tmp_path, self_contained):
    """The saved program calls opaque_autocast_test::matmul_autocast; a fresh
    process runs it in bfloat16, outside any autocast: with the library loaded,
    or, self-contained, without it (the variant's kernels traced to ATen)."""
    x = torch.randn(2, 3)
    stock, net = nets(ops, False)
    want = step(stock, x)[0]
    decomposed = torch.export.export(net, (x,), strict=False).run_decompositions()
    torch_opaque.save(decomposed, tmp_path / "autocast.pt2", self_contained=self_contained)
    torch.save({"x": x, "want": want}, tmp_path / "ref.pt")
    load_library = "" if self_contained else f"torch_opaque.load_library({str(LIB)!r})"
    out = last_json(run_python(f"""
        import json, torch, torch_opaque
        {load_library}
        ep = torch_opaque.load({str(tmp_path / "autocast.pt2")!r})
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        out = ep.module()(ref["x"])
        ops = sorted(str(n.target).split(".")[1] for n in ep.graph.nodes if "opaque_autocast_test" in str(n.target))
        print(json.dumps({{"dtype": str(out.dtype), "ops": ops, "library": {str(LIB)!r} in torch.ops.loaded_libraries,
                           "close": bool(torch.allclose(out.float(), ref["want"].float(), rtol=1e-2, atol=1e-2))}}))
    """))
    assert out == {"dtype": "torch.bfloat16", "ops": ["matmul_autocast"], "library": not self_contained,
                   "close": True}


def test_forward_ad_and_vmap_under_autocast_follow_it(ops):
    """The variant keeps the op's jvp and per-sample batching, run under the state."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    x, w, tx, xs = torch.randn(2, 3), torch.randn(3, 4), torch.randn(2, 3), torch.randn(5, 2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(ops.scaled_matmul(fwAD.make_dual(x, tx), w, 0.5))
        want, want_tangent = (x @ w) * 0.5, (tx @ w) * 0.5
        batched, want_batched = torch.func.vmap(lambda a: ops.matmul(a, w))(xs), xs @ w
    for got, ref in ((primal, want), (tangent, want_tangent), (batched, want_batched)):
        assert got.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_debug_mode_does_not_blame_the_fake_under_autocast(ops):
    """Its meta copies do not autocast, so the check is skipped there; outside
    autocast it still runs (and passes: the fake is right)."""
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    was = torch_opaque.debug_enabled()
    torch_opaque.set_debug(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = ops.scaled_matmul(x, w, 0.5), (x @ w) * 0.5
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        assert ops.scaled_matmul(x, w, 0.5).dtype == torch.float32
    finally:
        torch_opaque.set_debug(was)
