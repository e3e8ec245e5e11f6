"""torch_opaque.aoti: a training step (export_training) rewritten so that
AOTInductor packages it (each Name_bwd call becomes torch_opaque::call_bwd),
and the package's loss and gradients compared with eager autograd. The C++
side (examples/train_cpp, trained from C++ without Python) is a CTest test,
example_train_cpp_aoti_sgd."""

import pytest
import torch

import torch_opaque
import torch_opaque.aoti
from torch_opaque.ops import opaque_nodes


@torch_opaque.op(name="AotiTrainScaledSin")
class ScaledSin(torch.autograd.Function):
    """A float argument: its gradient slot is None."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.sin() * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.scale, None


@torch_opaque.op(name="AotiTrainRoundSTE")
class RoundSTE(torch.autograd.Function):
    """Saves nothing: Name_bwd gets an empty saved list."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 6)
        self.lin2 = torch.nn.Linear(6, 2)  # a 2-element bias: Inductor would inline it

    def forward(self, x, target):
        h = RoundSTE.apply(ScaledSin.apply(self.lin1(x), 1.5))
        return torch.nn.functional.mse_loss(self.lin2(h), target)


def eager_step(model, *args):
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def samples(batch):
    return torch.randn(batch, 4), torch.randn(batch, 2)


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    net = Net()
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch_opaque.export_training(net, samples(5), dynamic_shapes=({0: batch}, {0: batch}))
    return net, ep


def roles(ep):
    return sorted(f"{info.name}_{info.role}" for _, info in opaque_nodes(ep.graph_module))


def test_for_aoti_replaces_each_backward_call_and_computes_the_same(step):
    net, ep = step
    ready = torch_opaque.aoti.for_aoti(ep)
    calls = [n for n in ready.graph.nodes if n.target is torch.ops.torch_opaque.call_bwd.default]
    assert sorted(n.args[0] for n in calls) == [
        "opaque::AotiTrainRoundSTE_bwd.Tensor", "opaque::AotiTrainScaledSin_bwd.Tensor_float"]
    # ScaledSin's scale gets no gradient: only the tensor's is in the program.
    present = {n.args[0]: n.args[1] for n in calls}
    assert present["opaque::AotiTrainScaledSin_bwd.Tensor_float"] == [True, False]
    assert roles(ready) == ["AotiTrainRoundSTE_fwd", "AotiTrainScaledSin_fwd"]
    # The original program is left as it was.
    assert roles(ep) == ["AotiTrainRoundSTE_bwd", "AotiTrainRoundSTE_fwd",
                         "AotiTrainScaledSin_bwd", "AotiTrainScaledSin_fwd"]
    for batch in (3, 9):
        args = samples(batch)
        for got, want in zip(ready.module()(*args), eager_step(net, *args)):
            torch.testing.assert_close(got, want)


def test_a_program_without_backward_calls_is_copied_unchanged(step):
    net, _ = step
    ep = torch.export.export(net, samples(5))
    ready = torch_opaque.aoti.for_aoti(ep)
    assert ready is not ep
    assert ready.graph_module.code == ep.graph_module.code


def test_call_bwd_refuses_what_is_not_a_registered_backward():
    call_bwd = torch.ops.torch_opaque.call_bwd.default
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match=r"torch_opaque::call_bwd: nowhere::Missing_bwd.default "
                       r"is not a registered op\. Load the library that defines it"):
        call_bwd("nowhere::Missing_bwd.default", [True], [x], [x], [True], "", [])
    with pytest.raises(RuntimeError, match=r"torch_opaque::call_bwd: aten::sin.default is not the "
                       r"backward \(`Name_bwd`\) of a torch_opaque op"):
        call_bwd("aten::sin.default", [True], [x], [x], [True], "", [])


def test_call_bwd_refuses_a_gradient_the_backward_does_not_return(step):
    _, ep = step
    node = next(n for n, info in opaque_nodes(ep.graph_module)
                if info.role == "bwd" and info.name == "AotiTrainScaledSin")
    saved, grads, needs, state, ints = node.args
    x = torch.randn(5, 6)
    target = f"{node.target._schema.name}.{node.target._overloadname}"
    call_bwd = torch.ops.torch_opaque.call_bwd.default
    (g,) = call_bwd(target, [True, False], [x], [torch.ones(5, 6)], needs, state, ints)
    torch.testing.assert_close(g, x.cos() * 1.5)
    # The scale's slot is None: a program traced with a gradient there is refused.
    with pytest.raises(RuntimeError, match=r"returned no gradient for argument 1, which the "
                       r"program was traced with and uses"):
        call_bwd(target, [True, True], [x], [torch.ones(5, 6)], needs, state, ints)
    with pytest.raises(RuntimeError, match=r"returned 2 gradients, but the program was traced "
                       r"with 3"):
        call_bwd(target, [True, False, False], [x], [torch.ones(5, 6)], needs, state, ints)


def test_packaged_step_equals_eager_and_trains_on_updated_constants(step, tmp_path):
    net, ep = step
    package = torch_opaque.aoti.compile_and_package(ep, str(tmp_path / "step.pt2"))
    loaded = torch._inductor.aoti_load_package(package)
    # Every parameter stays a constant, the 2-element bias included.
    assert sorted(loaded.get_constant_fqns()) == sorted(n for n, _ in net.named_parameters())
    for batch in (3, 9):
        args = samples(batch)
        for got, want in zip(loaded(*args), eager_step(net, *args)):
            torch.testing.assert_close(got, want)
    # An SGD step in eager mode, handed to the package as its new constants.
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.1 * torch.randn_like(p)
    loaded.load_constants({n: p.detach().clone() for n, p in net.named_parameters()},
                          check_full_update=True)
    args = samples(7)
    for got, want in zip(loaded(*args), eager_step(net, *args)):
        torch.testing.assert_close(got, want)
