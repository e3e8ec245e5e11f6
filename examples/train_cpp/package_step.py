"""Exports the training step of a small network made of torch_opaque C++ ops
and packages it with AOTInductor, for train_step (train_step.cpp) to run.

    python examples/train_cpp/package_step.py OUT_DIR --lib build/train_cpp/libtrain_ops.so

writes, in OUT_DIR:
  step.pt2  the AOTInductor package of torch_opaque.export_training(Net(), ...):
            inputs (x, target) of a fixed batch size, outputs the loss and the
            gradients of the parameters; the parameters are the package's
            constants
  data.pt   torch.save of a dict that torch::pickle_load reads in C++:
            "inputs" [x, target], "names" the parameters, "params" their
            initial values, "lr", and the reference computed by stock PyTorch
            eager autograd on the same network written with torch.nn
            functions: "grads" (the first step's gradients) and "losses" (the
            loss before each of the SGD steps it took)

The network is train::linear -> train::tanh -> train::linear -> train::mse
(train_ops.cpp), each op with its own C++ backward, kept in the exported step
as a `Name_bwd` call; torch_opaque.aoti.compile_and_package packages it
(Note [Training programs in AOTInductor packages] in csrc/aoti_backward.cpp).
"""

import argparse
import pathlib
import time

import torch
import torch.nn.functional as F

import torch_opaque
import torch_opaque.aoti


class Net(torch.nn.Module):
    """Two linear layers with tanh between them, and the mean squared error."""

    def __init__(self, n_in=8, n_hidden=16, n_out=4):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(n_hidden, n_in) / n_in**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(n_hidden))
        self.w2 = torch.nn.Parameter(torch.randn(n_out, n_hidden) / n_hidden**0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x, target):
        ops = torch.ops.train
        h = ops.tanh(ops.linear(x, self.w1, self.b1))
        return ops.mse(ops.linear(h, self.w2, self.b2), target)


def stock_loss(params: dict, x, target):
    """Net's loss written with torch.nn functions: stock PyTorch autograd."""
    h = torch.tanh(F.linear(x, params["w1"], params["b1"]))
    return F.mse_loss(F.linear(h, params["w2"], params["b2"]), target)


def stock_sgd(params: dict, x, target, lr: float, steps: int):
    """Losses and first-step gradients of `steps` SGD steps, in eager PyTorch."""
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    losses, first = [], None
    for _ in range(steps):
        loss = stock_loss(params, x, target)
        grads = torch.autograd.grad(loss, list(params.values()))
        first = first or grads
        losses.append(loss.detach())
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= lr * g
    return torch.stack(losses), first


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--lib", type=pathlib.Path, required=True,
                        help="the ops library built from train_ops.cpp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    torch_opaque.load_library(args.lib)
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(args.batch, 8)
    target = torch.sin(x[:, :4] * 2)

    # Static shapes: the ops' kernels serve as their meta kernels, and a
    # broadcasting add (the bias) cannot run on meta tensors of a symbolic
    # size ("SymIntArrayRef expected to contain only concrete integers").
    t0 = time.perf_counter()
    step = torch_opaque.export_training(net, (x, target))
    names = torch_opaque.training_outputs(step)
    assert names == ["loss", "w1", "b1", "w2", "b2"], names
    print(f"export_training: {time.perf_counter() - t0:.1f}s")

    t0 = time.perf_counter()
    package = torch_opaque.aoti.compile_and_package(
        step, package_path=str(args.out_dir / "step.pt2"))
    print(f"aoti compile_and_package: {time.perf_counter() - t0:.1f}s -> {package}")

    params = dict(net.named_parameters())
    losses, grads = stock_sgd(params, x, target, args.lr, args.steps)

    # The custom backwards agree with stock autograd, eagerly and in the
    # package run from Python (a check before the C++ side).
    eager = torch.autograd.grad(net(x, target), list(params.values()))
    loaded = torch._inductor.aoti_load_package(package)
    packaged = loaded(x, target)
    torch.testing.assert_close(packaged[0], losses[0])
    for want, got_eager, got_package in zip(grads, eager, packaged[1:]):
        torch.testing.assert_close(got_eager, want)
        torch.testing.assert_close(got_package, want)
    print("python aoti_load_package: OK")

    torch.save({
        "inputs": [x, target],
        "names": names[1:],
        "params": [p.detach().clone() for p in params.values()],
        "lr": args.lr,
        "grads": [g.clone() for g in grads],
        "losses": losses,
    }, args.out_dir / "data.pt")
    print(f"wrote {args.out_dir}: step.pt2 data.pt ({args.steps} eager SGD steps, "
          f"loss {losses[0].item():.4f} -> {losses[-1].item():.4f})")


if __name__ == "__main__":
    main()
