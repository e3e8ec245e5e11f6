#!/usr/bin/env bash
# One entry point for a fresh machine or a warm one:
#   scripts/dev.sh demo   build everything, run the seed demo
#   scripts/dev.sh test   build everything, run pytest and CTest
#   scripts/dev.sh build  build only
#   scripts/dev.sh docs   build, then the documentation site into build/docs
# It installs what it needs: Debian packages (apt), a virtual environment in
# .venv with the pinned torch, and torch_opaque itself, built the way users get
# it (pip, scikit-build-core: pyproject.toml) as an editable install whose C++
# build tree is build/ (with the GoogleTest suite, for CTest).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TORCH_OPAQUE_VENV:-$ROOT/.venv}
# The torch to develop and test with; by default the one pyproject.toml's
# build-system requirements name.
TORCH_PIN=${TORCH_OPAQUE_TORCH:-}

log() { printf '\n== %s\n' "$*"; }

apt_deps() {
  local need=()
  # graphviz draws the docs' pictures (python -m torch_opaque inspect --graph);
  # chromium renders the built site in tests/test_docs.py.
  for pkg in cmake ninja-build g++ libgtest-dev libbenchmark-dev graphviz chromium; do
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
  # pyproject.toml holds the dependency lists: the build requirements
  # (scikit-build-core, torch) go in first, since the build uses this
  # environment's torch (--no-build-isolation); the test extra comes with the
  # package in build().
  local listed requires
  listed=$("$VENV/bin/python" - "$TORCH_PIN" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    requires = tomllib.load(f)["build-system"]["requires"]
pin = sys.argv[1]
for r in requires:
    print(pin if pin and r.replace(" ", "").startswith("torch=") else r)
PY
)
  mapfile -t requires <<<"$listed"
  if ! "$VENV/bin/python" - "${requires[@]}" <<'PY' 2>/dev/null
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
for r in map(Requirement, sys.argv[1:]):
    if not r.specifier.contains(importlib.metadata.version(r.name), prereleases=True):
        sys.exit(1)
PY
  then
    log "pip install ${requires[*]}"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${requires[@]}"
  fi
}

# ExecuTorch (tests/test_executorch.py): its wheel requires packages the tests
# do not need (coremltools, pandas, scikit-learn, ...), so it goes in without
# dependencies; the few it imports are pinned in the test extra (pyproject.toml).
EXECUTORCH_PIN=executorch==1.5.1

executorch_env() {
  if ! "$VENV/bin/python" - "$EXECUTORCH_PIN" <<'PY' 2>/dev/null
import importlib.metadata, sys
name, _, version = sys.argv[1].partition("==")
sys.exit(importlib.metadata.version(name) != version)
PY
  then
    log "pip install --no-deps $EXECUTORCH_PIN"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$EXECUTORCH_PIN"
  fi
}

build() {
  apt_deps
  python_env
  log "pip install --no-build-isolation -e .[test,docs] (C++ build in build/; the first one takes minutes)"
  # Editable: Python files come from torch_opaque/, the compiled files are
  # installed in site-packages/torch_opaque (lib/, include/, the CMake package).
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation \
    -C build-dir=build -C cmake.define.TORCH_OPAQUE_TESTS=ON -e ".[test,docs]"
  executorch_env
  local prefix
  prefix=$("$VENV/bin/python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
  log "examples/cpp against the installed CMake package (build/install)"
  examples/cpp/build_and_run.sh build "$prefix" --no-run >/dev/null
}

run_tests() {
  log "pytest"
  set +e
  # A test that needs ExecuTorch fails, not skips, when it is missing here.
  TORCH_OPAQUE_REQUIRE_EXECUTORCH=1 "$VENV/bin/python" -m pytest -q tests "$@"
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

docs() {
  log "sphinx-build -W docs build/docs"
  "$VENV/bin/python" -m sphinx -W --keep-going -q -b html -d build/docs_doctrees docs build/docs
  echo "open build/docs/index.html"
}

cmd=${1:-test}
shift || true
case "$cmd" in
  build) build ;;
  demo) build; "$VENV/bin/python" examples/seed_demo.py ;;
  test) build; run_tests "$@" ;;
  docs) build; docs ;;
  *) echo "usage: scripts/dev.sh demo|test|build|docs" >&2; exit 2 ;;
esac
