"""The seed example of pytorch/pytorch#106388, end to end.

1. Wrap the autograd.Function (the class body is unchanged).
2. Export through torch._dynamo.export and torch.export: one op node, no
   trampoline, no inlined `sin`.
3. Train one step through the exported program's module: the custom backward
   runs.
"""

import torch
import torch._dynamo

import torch_opaque


@torch_opaque.op(name="Foo")
class Foo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def f(x):
    return Foo.apply(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return Foo.apply(self.lin(x))


def main():
    torch.manual_seed(0)
    x = torch.randn([], requires_grad=True)

    print("== torch._dynamo.export(f, aten_graph=False)")
    gm, _ = torch._dynamo.export(f)(x)
    print(gm.code.strip())

    print("\n== torch.export.export(Model(), dynamic batch)")
    model = Model()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(
        model, (torch.randn(8, 4),), dynamic_shapes=({0: batch},)
    )
    print(ep.graph_module.code.strip())

    print("\n== training one step through ep.module()")
    trained = ep.module()
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    data, target = torch.randn(5, 4), torch.randn(5, 4)
    loss = torch.nn.functional.mse_loss(trained(data), target)
    loss.backward()
    ref = Model()
    ref.load_state_dict(model.state_dict())
    ref_loss = torch.nn.functional.mse_loss(ref(data), target)
    ref_loss.backward()
    same = all(
        torch.allclose(p.grad, q.grad)
        for p, q in zip(trained.parameters(), ref.parameters())
    )
    opt.step()
    new_loss = torch.nn.functional.mse_loss(trained(data), target)
    print(f"loss {loss.item():.4f} -> {new_loss.item():.4f} after one SGD step")
    print(f"gradients equal the eager model's: {same}")
    print(f"grad_fn of the op's output: {trained(data).grad_fn.name()}")


if __name__ == "__main__":
    main()
