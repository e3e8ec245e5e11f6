#!/usr/bin/env bash
# Builds benchmarks/cpp into build/bench_cpp (against the torch_opaque package
# in build/install) and runs it: paired rounds, the ratio torch_opaque /
# handwritten per round, its median and spread (bench_autograd.cpp).
#   benchmarks/cpp/run.sh [ROUNDS] [--iters N]
# e.g. benchmarks/cpp/run.sh 25 --iters 4000
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build/bench_cpp
rounds=${1:-15}
shift || true
python=${PYTHON:-$root/.venv/bin/python}
torch_prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
mkdir -p "$build"
cmake -S "$root/benchmarks/cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root/build/install;$torch_prefix" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build"
LD_LIBRARY_PATH="$root/build/install/lib:${LD_LIBRARY_PATH:-}" "$build/bench_autograd" \
  --rounds "$rounds" "$@"
