#!/usr/bin/env bash
# One entry point for a fresh machine or a warm one:
#   scripts/dev.sh demo   build everything, run the seed demo
#   scripts/dev.sh test   build everything, run pytest and CTest
#   scripts/dev.sh build  build only
# It installs what it needs: Debian packages (apt), a virtual environment in
# .venv with the pinned torch, the C++ build in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TORCH_OPAQUE_VENV:-$ROOT/.venv}
TORCH_PIN=${TORCH_OPAQUE_TORCH:-torch==2.13.0}
PY_PACKAGES=(numpy pytest expecttest hypothesis onnx onnxscript onnxruntime graphviz sybil)

log() { printf '\n== %s\n' "$*"; }

apt_deps() {
  local need=()
  for pkg in cmake ninja-build g++ libgtest-dev libbenchmark-dev graphviz; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    log "apt-get install ${need[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

python_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import torch, numpy, pytest, expecttest, hypothesis, onnx, onnxscript, onnxruntime, graphviz, sybil" 2>/dev/null; then
    log "pip install $TORCH_PIN ${PY_PACKAGES[*]}"
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_PIN" "${PY_PACKAGES[@]}"
  fi
}

build() {
  apt_deps
  python_env
  local prefix
  prefix=$("$VENV/bin/python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
  log "cmake build (build/)"
  cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
    -DPython3_EXECUTABLE="$VENV/bin/python" >/dev/null
  cmake --build build --parallel "$(nproc)"
  log "examples/cpp against the installed CMake package (build/install)"
  examples/cpp/build_and_run.sh build "$prefix" --no-run >/dev/null
  if ! "$VENV/bin/pip" show -q torch-opaque >/dev/null 2>&1; then
    log "pip install -e . (no build isolation)"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
  fi
}

run_tests() {
  log "pytest"
  set +e
  "$VENV/bin/python" -m pytest -q tests "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    return 1
  fi
  [ $rc -eq 0 ] || return $rc
  log "ctest"
  (cd build && ctest --output-on-failure)
}

cmd=${1:-test}
shift || true
case "$cmd" in
  build) build ;;
  demo) build; "$VENV/bin/python" examples/seed_demo.py ;;
  test) build; run_tests "$@" ;;
  *) echo "usage: scripts/dev.sh demo|test|build" >&2; exit 2 ;;
esac
