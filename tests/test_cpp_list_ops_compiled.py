"""Tensor[] gradients of C++ ops under torch.compile (inductor and aot_eager,
fullgraph) and in eager mode: every list element's gradient reaches the
tensor it came from (Note [Tensor-list gradients] in
include/torch_opaque/detail/finishers.h), and a backward that returns one
tensor (or views of one tensor) for several elements gives the traced
`_bwd` node one output per element (Note [Backward results do not alias]).

The ops (tests/cpp/list_grad_test_ops.cpp) are written the way users write
them: `const std::vector<at::Tensor>&`, a forward that starts from
at::zeros_like(xs[0]), a backward that returns
std::vector<torch_opaque::Gradient>. The reference is the same math in torch
ops, differentiated by autograd."""

import operator

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from support.build_tree import TEST_LIBS, missing

LIB = TEST_LIBS / "liblist_grad_test_ops.so"
BACKENDS = ["eager", "aot_eager", "inductor"]


@pytest.fixture(scope="module")
def ops():
    import torch_opaque

    assert LIB.exists(), missing(LIB)
    torch_opaque.load_library(LIB)
    return torch.ops.opaque_list_compile_test


def weighted_sum_ref(xs, w):
    out = torch.zeros_like(xs[0])
    for i, x in enumerate(xs):
        out = out + x * w[i]
    return out


def scaled_sum_ref(xs, s):
    return sum(xs) * s


# How the list is made from the module's input x: (a) outputs of different
# Linear layers (and x), (b) the same tensor twice, (c) the input itself,
# (d) views.
LISTS = {
    "linear_outputs": lambda m, x: [m.lin1(x), m.lin2(x), x],
    "same_tensor_twice": lambda m, x: [m.lin1(x), m.lin1(x), x, x],
    "input_itself": lambda m, x: [x],
    "views": lambda m, x: [x[1:], m.lin2(x)[1:], x.t()[:, :2].t()],
}


class Model(torch.nn.Module):
    def __init__(self, op, make_list):
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 4)
        self.lin2 = torch.nn.Linear(4, 4)
        self.op = op
        self.make_list = make_list

    def forward(self, x, w):
        return self.op(self.make_list(self, x), w)


def grads_of(op, case, backend, n_weights=None):
    """Output and gradients of Model(op, LISTS[case]) run by `backend`."""
    torch.manual_seed(0)
    model = Model(op, LISTS[case])
    x = torch.randn(3, 4, requires_grad=True)
    n = n_weights or len(LISTS[case](model, x.detach()))
    w = torch.randn(n, requires_grad=True)
    f = model if backend == "eager" else torch.compile(model, backend=backend, fullgraph=True)
    out = f(x, w)
    out.backward(torch.randn(out.shape))
    named = {"x": x, "w": w, **dict(model.named_parameters())}
    return out.detach(), {name: t.grad for name, t in named.items()}


def assert_same_grads(got, ref, backend):
    torch.testing.assert_close(got[0], ref[0])
    for name, r in ref[1].items():
        g = got[1][name]
        if r is None:
            assert g is None, f"{name} under {backend}: a gradient where autograd has none"
        else:
            assert g is not None, f"{name} under {backend}: no gradient (autograd has one)"
            torch.testing.assert_close(g, r, msg=lambda m: f"{name} under {backend}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LISTS))
def test_list_gradients_match_autograd(ops, case, backend):
    torch._dynamo.reset()
    ref = grads_of(weighted_sum_ref, case, "eager")
    assert_same_grads(grads_of(ops.weighted_sum, case, backend), ref, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["linear_outputs", "same_tensor_twice", "views"])
def test_one_gradient_for_every_element(ops, case, backend):
    torch._dynamo.reset()
    ref = grads_of(scaled_sum_ref, case, "eager", n_weights=1)
    assert_same_grads(grads_of(ops.scaled_sum, case, backend, n_weights=1), ref, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_as_views_of_one_tensor(ops, backend):
    torch._dynamo.reset()
    ref = grads_of(weighted_sum_ref, "linear_outputs", "eager")
    assert_same_grads(grads_of(ops.stacked_weighted_sum, "linear_outputs", backend), ref, backend)


@pytest.mark.parametrize("op_name", ["scaled_sum", "stacked_weighted_sum", "weighted_sum"])
def test_traced_backward_reads_each_element_from_its_own_output(ops, op_name):
    """The compiled backward takes each list element's gradient from its own
    `_bwd` output (one tensor returned for all elements was recorded as one
    output, the last, read for every element)."""
    graphs = []

    def bw_compiler(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=bw_compiler)
    torch._dynamo.reset()
    n_weights = 1 if op_name == "scaled_sum" else None
    grads_of(getattr(ops, op_name), "linear_outputs", backend, n_weights)
    (graph,) = graphs
    (bwd,) = [n for n in graph.graph.nodes if n.target is getattr(ops, op_name + "_bwd").default]
    read = sorted(u.args[1] for u in bwd.users if u.target is operator.getitem)
    assert read == [0, 1, 2, 3]  # three list elements, then the weight


# ---- a rebuilt library and Inductor's caches ------------------------------------

REBUILT_CHILD = r"""
import sys, torch, torch_opaque
torch_opaque.load_library(sys.argv[1])
op = torch.ops.opaque_rebuilt_test.weighted_sum

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 4)
        self.lin2 = torch.nn.Linear(4, 4)

    def forward(self, x, w, f):
        return f([self.lin1(x), self.lin2(x), x], w)

def grads(f, compiled):
    torch.manual_seed(0)
    m = Model()
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    run = torch.compile(m, backend="inductor", fullgraph=True) if compiled else m
    run(x, w, f).sum().backward()
    return [x.grad, w.grad, m.lin1.weight.grad]

ref = grads(lambda xs, w: sum(t * w[i] for i, t in enumerate(xs)), False)
got = grads(op, True)
print("none" if got[0] is None else
      "same" if all(torch.allclose(a, b) for a, b in zip(got, ref)) else "different")
"""


def test_rebuilt_library_is_not_served_from_inductors_cache(tmp_path):
    """Note [Compile caches and C++ libraries]: a library rebuilt with a fixed
    backward, loaded from the same path, is compiled again (a warm cache
    served the old compiled backward: x.grad None)."""
    import os
    import shutil
    import subprocess
    import sys

    built = LIB.parent
    lib = tmp_path / "libmyops.so"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)

    def run():
        out = subprocess.run([sys.executable, "-c", REBUILT_CHILD, str(lib)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()[-1]

    shutil.copy(built / "librebuilt_backward_ops_0.so", lib)
    assert run() == "none"  # the first build gives the list elements no gradient
    shutil.copy(built / "librebuilt_backward_ops_1.so", lib)
    assert run() == "same"
    assert run() == "same"  # and again, from the cache it filled
    assert any((tmp_path / "cache").rglob("*")), "Inductor's cache stayed empty"
