#!/usr/bin/env bash
# Builds benchmarks/cpp into build/bench_cpp (against the torch_opaque package
# in build/install) and runs it; the table at the end has the medians and the
# ratio torch_opaque / handwritten.
#   benchmarks/cpp/run.sh [REPETITIONS] [more --benchmark_* flags]
# e.g. benchmarks/cpp/run.sh 30 --benchmark_min_time=0.2
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build/bench_cpp
reps=${1:-20}
shift || true
python=${PYTHON:-$root/.venv/bin/python}
torch_prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
mkdir -p "$build"
cmake -S "$root/benchmarks/cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root/build/install;$torch_prefix" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build"
LD_LIBRARY_PATH="$root/build/install/lib:${LD_LIBRARY_PATH:-}" "$build/bench_autograd" \
  --benchmark_repetitions="$reps" --benchmark_enable_random_interleaving=true \
  --benchmark_report_aggregates_only=true --benchmark_min_time=0.1 "$@"
