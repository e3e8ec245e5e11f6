#!/usr/bin/env bash
# Installs torch_opaque from the main build into build/install, builds
# examples/train_cpp against the installed CMake package, packages the training
# step with AOTInductor (Python) and trains with it from C++ (no Python).
#   examples/train_cpp/build_and_run.sh BUILD_DIR TORCH_CMAKE_PREFIX PYTHON
set -euo pipefail
build=$(cd "$1" && pwd) torch_prefix=$2 python=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
out="$build/examples_train_cpp"
cmake --install "$build" --prefix "$build/install" >/dev/null
cmake -S "$root/examples/train_cpp" -B "$out" -G Ninja \
  -DCMAKE_PREFIX_PATH="$build/install;$torch_prefix" >/dev/null
cmake --build "$out"
"$python" "$root/examples/train_cpp/package_step.py" "$out/package" --lib "$out/libtrain_ops.so"
# No Python from here on: the program's RUNPATH finds libtorch, libtorch_opaque
# and the ops library.
env -u PYTHONPATH -u LD_LIBRARY_PATH "$out/train_step" "$out/package/step.pt2" \
  "$out/package/data.pt"
