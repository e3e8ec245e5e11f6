"""Packages a model that calls torch_opaque C++ ops with AOTInductor.

    python examples/aoti/package_model.py OUT_DIR [--lib build/examples_cpp/libexample_ops.so]

writes, in OUT_DIR:
  model.pt2       the AOTInductor package (torch._inductor.aoti_compile_and_package)
  inputs_I.pt     sample I's inputs         } torch.save of a list of tensors,
  expected_I.pt   its eager outputs         } which torch::pickle_load reads in C++
                  (one sample per --batches size: the batch dimension is dynamic)

run_package (run_package.cpp, built with this folder's CMakeLists.txt) loads
model.pt2 with torch::inductor::AOTIModelPackageLoader, runs it on each
inputs_I.pt and compares with expected_I.pt:

    run_package OUT_DIR/model.pt2 OUT_DIR/inputs_0.pt OUT_DIR/expected_0.pt ...

The compiled model calls example::scaled_sin, example::top_value,
example::weighted_sum and example::power_means through
AOTI's proxy executor, which finds them in the dispatcher by name when the
package is loaded: the process that loads it must have loaded the ops library
first (run_package links it), or loading fails with "Could not find schema for
example::scaled_sin".
"""

import argparse
import pathlib
import time

import torch

import torch_opaque

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_LIB = ROOT / "build" / "examples_cpp" / "libexample_ops.so"


class Model(torch.nn.Module):
    """Linear -> example::scaled_sin -> Linear -> example::top_value, and
    example::weighted_sum (a Tensor[] argument) and example::power_means (a
    Tensor[] return) on the way."""

    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(8, 16)
        self.lin2 = torch.nn.Linear(16, 5)
        self.mix = torch.nn.Parameter(torch.tensor([0.5, -1.5]))

    def forward(self, x):
        h = torch.ops.example.scaled_sin(self.lin1(x), 2.0)
        y = self.lin2(h)
        values, indices = torch.ops.example.top_value(y, 1)
        s = torch.ops.example.weighted_sum([y, y.cos()], self.mix)
        m1, m2 = torch.ops.example.power_means(s, [1, 2])
        return y, values, indices, m1 + m2


def save_tensors(path: pathlib.Path, tensors) -> None:
    """torch.save of a list of tensors: torch::pickle_load reads it from C++."""
    torch.save([t.detach().contiguous().clone() for t in tensors], path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--lib", type=pathlib.Path, default=DEFAULT_LIB,
                        help="the ops library (default: %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 7],
                        help="batch sizes of the saved samples; the package takes "
                             "any batch size (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    torch_opaque.load_library(args.lib)
    torch.manual_seed(0)
    model = Model().eval()
    samples = [(torch.randn(b, 8),) for b in args.batches]
    with torch.no_grad():
        expected = [model(*inputs) for inputs in samples]

    t0 = time.perf_counter()
    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(model, samples[0], dynamic_shapes=({0: batch},))
    print(f"export: {time.perf_counter() - t0:.1f}s")

    from torch._inductor.cpp_builder import get_cpp_compiler
    print(f"compiler: {get_cpp_compiler()}")
    t0 = time.perf_counter()
    package = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(args.out_dir / "model.pt2"))
    print(f"aoti_compile_and_package: {time.perf_counter() - t0:.1f}s -> {package}")

    # The package also runs from Python: a check before the C++ side.
    loaded = torch._inductor.aoti_load_package(package)
    for inputs, want in zip(samples, expected):
        for got, e in zip(loaded(*inputs), want):
            torch.testing.assert_close(got, e)
    print("python aoti_load_package: OK")

    names = []
    for i, (inputs, want) in enumerate(zip(samples, expected)):
        save_tensors(args.out_dir / f"inputs_{i}.pt", inputs)
        save_tensors(args.out_dir / f"expected_{i}.pt", want)
        names += [f"inputs_{i}.pt", f"expected_{i}.pt"]
    print(f"wrote {args.out_dir}: model.pt2 {' '.join(names)}")


if __name__ == "__main__":
    main()
