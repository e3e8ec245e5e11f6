"""C++ ops with tensor lists (examples/cpp/tensor_list_ops.cpp): Tensor[]
arguments whose elements each get a gradient (example::weighted_sum), and a
Tensor[] return (example::power_means), in eager, opcheck, export and compile."""

import pytest
import torch

from conftest import op_calls

pytestmark = pytest.mark.usefixtures("example_ops")


def weighted_sum_ref(xs, w):
    return sum(x * w[i] for i, x in enumerate(xs))


def power_means_ref(x, orders):
    return [x.pow(k).mean(-1) for k in orders]


def test_schemas():
    assert str(torch.ops.example.weighted_sum.default._schema) == (
        "example::weighted_sum(Tensor[] xs, Tensor w) -> Tensor"
    )
    assert str(torch.ops.example.power_means.default._schema) == (
        "example::power_means(Tensor x, int[] orders=[1, 2]) -> Tensor[]"
    )
    assert str(torch.ops.example.power_means_fwd.default._schema).endswith(
        "-> (Tensor[], Tensor[])"
    )


def test_list_elements_get_gradients():
    xs = [torch.randn(3, 4, dtype=torch.double, requires_grad=True) for _ in range(3)]
    w = torch.randn(3, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: torch.ops.example.weighted_sum(list(a[:-1]), a[-1]), (*xs, w)
    )
    out = torch.ops.example.weighted_sum(xs, w)
    ref_in = [t.detach().clone().requires_grad_() for t in (*xs, w)]
    ref = weighted_sum_ref(ref_in[:-1], ref_in[-1])
    torch.testing.assert_close(out, ref)
    gy = torch.randn_like(out)
    out.backward(gy)
    ref.backward(gy)
    for t, r in zip((*xs, w), ref_in):
        torch.testing.assert_close(t.grad, r.grad)


def test_only_some_elements_require_grad():
    xs = [torch.randn(4), torch.randn(4, requires_grad=True)]
    w = torch.randn(2)
    out = torch.ops.example.weighted_sum(xs, w)
    assert out.requires_grad
    out.sum().backward()
    assert xs[0].grad is None
    torch.testing.assert_close(xs[1].grad, w[1].expand(4))


def test_list_return_values_and_gradients():
    x = torch.randn(3, 5, dtype=torch.double, requires_grad=True)
    outs = torch.ops.example.power_means(x, [1, 2, 3])
    assert isinstance(outs, list) and len(outs) == 3
    for o, r in zip(outs, power_means_ref(x.detach(), [1, 2, 3])):
        torch.testing.assert_close(o, r)
    assert len(torch.ops.example.power_means(x)) == 2  # orders=[1, 2] by default
    assert torch.autograd.gradcheck(
        lambda t: tuple(torch.ops.example.power_means(t, [1, 2, 3])), (x,)
    )
    # one element used: the others get no gradient (zeros, materialized)
    torch.ops.example.power_means(x, [2, 3])[1].sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2 / 5)


@pytest.mark.parametrize(
    "name,args",
    [
        ("weighted_sum", ([torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
                          torch.randn(2, requires_grad=True))),
        ("weighted_sum", ([torch.randn(2, 3)], torch.randn(1))),
        ("power_means", (torch.randn(3, 4, requires_grad=True), [1, 2, 3])),
    ],
)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.example, name).default, args)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        xs = [self.lin(x), x.sin(), x * 2]
        y = torch.ops.example.weighted_sum(xs, self.w)
        m1, m2 = torch.ops.example.power_means(y, [1, 2])
        return m1 + m2


@pytest.mark.parametrize("strict", [False, True])
def test_export_and_train_the_exported_module(strict):
    torch.manual_seed(0)
    model = Model()
    ep = torch.export.export(
        model, (torch.randn(6, 4),), dynamic_shapes=({0: torch.export.Dim("b")},), strict=strict
    )
    for prog in (ep, ep.run_decompositions()):
        assert len(op_calls(prog.graph_module, "weighted_sum", "example")) == 1
        assert len(op_calls(prog.graph_module, "power_means", "example")) == 1
    x = torch.randn(9, 4)
    mod = ep.module()
    torch.testing.assert_close(mod(x), model(x))
    mod(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(mod.named_parameters(), model.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    torch.manual_seed(0)
    model = Model()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, ref = compiled(x), model(x2)
        torch.testing.assert_close(out, ref)
        model.zero_grad()
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad)


def test_double_backward_through_lists():
    """The `_bwd` op's Autograd kernel (double backward) with one gradient per
    list element and per Tensor[] output."""
    xs = [torch.randn(3, dtype=torch.double, requires_grad=True) for _ in range(2)]
    w = torch.randn(2, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda a, b, w: torch.ops.example.weighted_sum([a, b], w), (*xs, w)
    )
    x = torch.randn(2, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda t: tuple(torch.ops.example.power_means(t, [2, 3])), (x,)
    )
