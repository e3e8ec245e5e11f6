#!/usr/bin/env bash
# Installs torch_opaque from the main build into build/install, builds this
# example against the installed CMake package, and runs it.
#   examples/cpp/build_and_run.sh BUILD_DIR TORCH_CMAKE_PREFIX [--no-run]
set -euo pipefail
build=$(cd "$1" && pwd) torch_prefix=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
cmake --install "$build" --prefix "$build/install" >/dev/null
cmake -S "$root/examples/cpp" -B "$build/examples_cpp" -G Ninja \
  -DCMAKE_PREFIX_PATH="$build/install;$torch_prefix" >/dev/null
cmake --build "$build/examples_cpp"
[ "${3:-}" = "--no-run" ] || LD_LIBRARY_PATH="$build/install/lib:${LD_LIBRARY_PATH:-}" \
  "$build/examples_cpp/example_main"
