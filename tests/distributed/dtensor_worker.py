"""One rank of tests/distributed/test_dtensor.py: DTensor and tensor-parallel
checks of opaque ops against the stock Functions (Note [Sharding opaque ops]).

    python dtensor_worker.py RANK WORLD_SIZE PORT [EXAMPLE_OPS_LIB]

Prints one JSON object: check name -> "ok" or the failure's traceback.
"""

import contextlib
import json
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import torch_opaque
from torch_opaque.errors import UnsupportedError


def cube_class(name):
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g + 1  # not autodiff's: the custom backward must run

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": "dtensor_worker"})


def linear_class(name):
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.flatten(0, -2).t() @ x.flatten(0, -2), g.flatten(0, -2).sum(0)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": "dtensor_worker"})


def linear_rule(x, w, b):
    """Column-parallel (ColwiseParallel) and data-parallel (Shard(0) input)."""
    return [
        ([Replicate()], [Replicate(), Replicate(), Replicate()]),
        ([Shard(x.ndim - 1)], [Replicate(), Shard(0), Shard(0)]),
        ([Shard(0)], [Shard(0), Replicate(), Replicate()]),
    ]


def same(a, b, placements=True):
    """Values (full tensors), dtypes and (unless told) placements equal."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, DTensor):
        assert not placements or a.placements == b.placements, (a.placements, b.placements)
        a, b = a.full_tensor(), b.full_tensor()
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    torch.testing.assert_close(a, b)


def grads_equal(a, b):
    """Gradients: values and dtypes (placements may differ: Partial vs Replicate)."""
    assert (a is None) == (b is None)
    if a is not None:
        a = a.full_tensor() if isinstance(a, DTensor) else a
        b = b.full_tensor() if isinstance(b, DTensor) else b
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


def leaf(mesh, full, placements):
    return distribute_tensor(full.clone(), mesh, placements).requires_grad_()


def run_both(op_cls, stock_cls, mesh, fulls, placements, dtype=torch.float32,
             op_mode=contextlib.nullcontext, same_placements=True):
    """The same call of both classes on fresh DTensor leaves; compares outputs and grads."""
    xs = [leaf(mesh, f.to(dtype), p) for f, p in zip(fulls, placements)]
    ys = [leaf(mesh, f.to(dtype), p) for f, p in zip(fulls, placements)]
    with op_mode():
        out = op_cls.apply(*xs)
    ref = stock_cls.apply(*ys)
    same(out, ref, same_placements)
    assert not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction), "stock ran"
    (out.full_tensor() * torch.arange(out.numel()).view(out.shape)).sum().backward()
    (ref.full_tensor() * torch.arange(ref.numel()).view(ref.shape)).sum().backward()
    for a, b in zip(xs, ys):
        grads_equal(a.grad, b.grad)
    return out


def check_pointwise_wrap(mesh):
    Cube, Stock = cube_class("CubeW"), cube_class("CubeWStock")
    torch_opaque.wrap(Cube)
    torch_opaque.register_sharding(Cube, "pointwise")
    full = torch.randn(4, 3)
    for p in ([Replicate()], [Shard(0)], [Shard(1)]):
        run_both(Cube, Stock, mesh, [full], [p])
    run_both(Cube, Stock, mesh, [full], [[Shard(0)]], dtype=torch.float64)
    with torch.no_grad():  # the inference op (Name), sharded by DTensor itself
        x = distribute_tensor(full, mesh, [Shard(0)])
        same(Cube.apply(x), Stock.apply(x))
    # a Partial input is reduced first (pointwise ops are not linear); DTensor
    # picks the cheapest acceptable placement (a reduce-scatter to Shard(0)),
    # where stock's decomposition gives Replicate: values are equal
    part = DTensor.from_local(full.clone(), mesh, [Partial()], run_check=False)
    same(Cube.apply(part), Stock.apply(part), placements=False)


def check_linear_rule(mesh):
    Lin, Stock = linear_class("LinR"), linear_class("LinRStock")
    torch_opaque.wrap(Lin)
    torch_opaque.register_sharding(Lin, linear_rule)
    x, w, b = torch.randn(4, 3), torch.randn(6, 3), torch.randn(6)
    run_both(Lin, Stock, mesh, [x, w, b], [[Replicate()], [Shard(0)], [Shard(0)]])
    run_both(Lin, Stock, mesh, [x, w, b], [[Shard(0)], [Replicate()], [Replicate()]])
    # no acceptable placement as given: DTensor redistributes the inputs first
    # (to the rule's Replicate strategy, where stock's matmul gives Partial)
    run_both(Lin, Stock, mesh, [x, w, b], [[Shard(1)], [Shard(1)], [Replicate()]],
             same_placements=False)


def check_colwise_parallel(mesh):
    Lin, Stock = linear_class("LinTP"), linear_class("LinTPStock")
    torch_opaque.wrap(Lin)
    torch_opaque.register_sharding(Lin, linear_rule)

    class Layer(torch.nn.Linear):
        cls = None

        def forward(self, x):
            return self.cls.apply(x, self.weight, self.bias)

    torch.manual_seed(0)
    models = []
    for cls in (Lin, Stock):
        torch.manual_seed(0)
        m = torch.nn.Sequential(Layer(3, 6))
        m[0].cls = cls
        models.append(parallelize_module(m, mesh, {"0": ColwiseParallel(use_local_output=False)}))
    x = torch.randn(5, 3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = models[0](xa), models[1](xb)
    same(out, ref)
    assert out.placements == (Shard(1),)
    out.full_tensor().pow(2).sum().backward()
    ref.full_tensor().pow(2).sum().backward()
    grads_equal(xa.grad, xb.grad)
    for pa, pb in zip(models[0].parameters(), models[1].parameters()):
        grads_equal(pa.grad, pb.grad)
        assert pa.grad.placements == pb.grad.placements


def check_missing_rule(mesh):
    Cube = cube_class("CubeNoRule")
    torch_opaque.wrap(Cube)
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    try:
        Cube.apply(x)
    except UnsupportedError as e:
        assert "torch_opaque.register_sharding(CubeNoRule, rule)" in str(e), str(e)
        assert "'pointwise'" in str(e), str(e)
    else:
        raise AssertionError("no error")
    try:
        torch_opaque.register_sharding(Cube, "colwise")
    except TypeError as e:
        assert "rule must be 'pointwise' or a function" in str(e), str(e)
    else:
        raise AssertionError("no error")


def check_auto_without_rule(mesh):
    """A DTensor call runs stock, that call only: a later export keeps the op."""
    Cube, Stock = cube_class("CubeAuto"), cube_class("CubeAutoStock")
    full = torch.randn(4, 3)
    x, y = leaf(mesh, full, [Shard(0)]), leaf(mesh, full, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught, torch_opaque.auto() as report:
        warnings.simplefilter("always")
        out = Cube.apply(x)
    ref = Stock.apply(y)
    same(out, ref)
    out.sum().backward()
    ref.sum().backward()
    grads_equal(x.grad, y.grad)
    assert any("no sharding rule" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert "no sharding rule" in report.fallbacks[Cube]

    class M(torch.nn.Module):
        def forward(self, t):
            return Cube.apply(t)

    with torch_opaque.auto():
        ep = torch.export.export(M(), (torch.randn(4, 3),))
    assert torch_opaque._impl.auto_state.fallen_back(Cube) is None
    assert any("CubeAuto" in str(n.target) for n in ep.graph.nodes), ep.graph


def check_auto_with_rule(mesh):
    Cube, Stock = cube_class("CubeAutoRule"), cube_class("CubeAutoRuleStock")
    torch_opaque.register_sharding(Cube, "pointwise")
    reports = []

    @contextlib.contextmanager
    def auto():
        with torch_opaque.auto() as report:
            reports.append(report)
            yield

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back warning
        run_both(Cube, Stock, mesh, [torch.randn(4, 3)], [[Shard(0)]], op_mode=auto)
        run_both(Cube, Stock, mesh, [torch.randn(4, 3)], [[Replicate()]], op_mode=auto)
    for report in reports:
        assert Cube in report.ops and not report.fallbacks, report


def two_outputs_class(name):
    def forward(ctx, x, k: float):
        y, z = x.exp(), x * k
        ctx.save_for_backward(y)  # an output saved, and ctx state
        ctx.k = k
        return y, z

    def backward(ctx, gy, gz):
        (y,) = ctx.saved_tensors
        return gy * y + gz * ctx.k, None

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": "dtensor_worker"})


def check_two_outputs(mesh):
    Two, Stock = two_outputs_class("TwoOut"), two_outputs_class("TwoOutStock")
    torch_opaque.wrap(Two)
    torch_opaque.register_sharding(Two, "pointwise")
    full = torch.randn(4, 3, dtype=torch.float64)
    for p in ([Shard(1)], [Replicate()]):
        x, y = leaf(mesh, full, p), leaf(mesh, full, p)
        outs, refs = Two.apply(x, 3.0), Stock.apply(y, 3.0)
        for a, b in zip(outs, refs):
            same(a, b)
        (outs[0] * outs[1]).full_tensor().sum().backward()
        (refs[0] * refs[1]).full_tensor().sum().backward()
        grads_equal(x.grad, y.grad)


def check_compiled(mesh):
    """torch.compile (aot_eager, one graph) of the op with a rule, and of a class
    without one under auto() (stock for that call), against stock eager."""
    Cube, NoRule, Stock = cube_class("CubeJit"), cube_class("CubeJitAuto"), cube_class("CubeJitStock")
    torch_opaque.wrap(Cube)
    torch_opaque.register_sharding(Cube, "pointwise")
    full = torch.randn(4, 3)
    ref_x = leaf(mesh, full, [Shard(0)])
    ref = Stock.apply(ref_x) * 2
    ref.full_tensor().sum().backward()
    for cls, mode in ((Cube, contextlib.nullcontext), (NoRule, torch_opaque.auto)):
        torch._dynamo.reset()
        x = leaf(mesh, full, [Shard(0)])
        with warnings.catch_warnings(), mode():
            warnings.simplefilter("ignore")
            out = torch.compile(lambda t: cls.apply(t) * 2, backend="aot_eager", fullgraph=True)(x)
        same(out, ref)
        out.full_tensor().sum().backward()
        grads_equal(x.grad, ref_x.grad)
    assert torch_opaque._impl.auto_state.fallen_back(NoRule) is None


def check_cpp_op(mesh, lib):
    torch_opaque.load_library(lib)
    op = torch.ops.example.scaled_sin
    torch_opaque.register_sharding(op, "pointwise")
    full = torch.randn(4, 3)
    for p in ([Replicate()], [Shard(0)]):
        x = leaf(mesh, full, p)
        ref_x = full.clone().requires_grad_()
        out, ref = op(x, 2.0), op(ref_x, 2.0)
        assert out.placements == tuple(p) and out.dtype == ref.dtype
        torch.testing.assert_close(out.full_tensor(), ref)
        out.full_tensor().sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    lib = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (world,))
    checks = {name: f for name, f in globals().items() if name.startswith("check_")}
    results = {}
    for name, f in checks.items():
        torch.manual_seed(1234)  # same inputs on every rank
        try:
            f(mesh, lib) if name == "check_cpp_op" else f(mesh)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
