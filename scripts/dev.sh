#!/usr/bin/env bash
# One entry point for a fresh machine or a warm one:
#   scripts/dev.sh demo    build everything, run the seed demo
#   scripts/dev.sh test    build everything, run pytest and CTest; then the
#                          release matrix (below)
#   scripts/dev.sh matrix  the release matrix only
#   scripts/dev.sh build   build only
#   scripts/dev.sh docs    build, then the documentation site into build/docs
# It installs what it needs: Debian packages (apt), a virtual environment in
# .venv with the pinned torch, and torch_opaque itself, built the way users get
# it (pip, scikit-build-core: pyproject.toml) as an editable install whose C++
# build tree is build/ (with the GoogleTest suite, for CTest).
#
# Note [The release matrix]: torch_opaque supports the torch releases of
# pyproject.toml's range, and `scripts/dev.sh test` tests each of them. The
# whole suite runs on the dev pin (pyproject.toml's build-system requirement,
# in .venv, built in build/). Then, for each release of RELEASES below, in
# .venv-torch-X.Y with the build tree build-torch-X.Y (Note [One build tree per
# torch release] in tests/support/build_tree.py): the build (the C++ examples
# against the installed CMake package included), the seed demo, the tests of
# tests/release_subset.txt under coverage, a check that they ran code of every
# module of the package (scripts/check_release_coverage.py), and CTest less
# its `slow` label. Then archives written under each release are loaded under
# the others (scripts/check_archive_compat.sh --across: Note [Archives across
# releases]). Their torch downloads run in the background while the dev pin's
# suite runs. The whole suite on any release: TORCH_OPAQUE_TORCH=2.15.0
# scripts/dev.sh test. TORCH_OPAQUE_RELEASES="2.15.0" (or "") picks the
# matrix; `test` with pytest arguments runs only those, on one release.
RELEASES=${TORCH_OPAQUE_RELEASES-"2.14.1 2.15.0"}
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

log() { printf '\n== %s\n' "$*"; }

# The dev pin: the torch of pyproject.toml's build-system requirements.
DEV_PIN=$(grep -m1 '^requires *=' pyproject.toml | grep -o 'torch==[0-9][0-9a-z.+]*' | cut -d= -f3)

# Sets TORCH_PIN (a requirement, "" for the dev pin), VENV and BUILD (the C++
# build tree, relative to the root) for release $1 (X.Y.Z, torch==X.Y.Z, or ""
# for the dev pin). TORCH_OPAQUE_VENV and TORCH_OPAQUE_BUILD_DIR override the
# last two, except in the matrix ($2 = matrix).
select_release() {
  local rel=${1#torch==} minor
  if [ -z "$rel" ] || [ "$rel" = "$DEV_PIN" ]; then
    TORCH_PIN="" VENV=$ROOT/.venv BUILD=build
  else
    minor=$(cut -d. -f1,2 <<<"$rel")
    TORCH_PIN="torch==$rel" VENV=$ROOT/.venv-torch-$minor BUILD=build-torch-$minor
  fi
  if [ "${2:-}" != matrix ]; then
    VENV=${TORCH_OPAQUE_VENV:-$VENV} BUILD=${TORCH_OPAQUE_BUILD_DIR:-$BUILD}
  fi
  PIP_ENV=()
}

# pip in $VENV, with the settings Note [A pip configuration that caps torch]
# (scripts/pip_settings.py) gives it.
vpip() { env "${PIP_ENV[@]}" "$VENV/bin/pip" "$@"; }

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
  mapfile -t PIP_ENV < <("$VENV/bin/python" scripts/pip_settings.py "$VENV/bin/pip" "${TORCH_PIN:-torch==$DEV_PIN}")
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
    vpip install -q --disable-pip-version-check "${requires[@]}"
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
    vpip install -q --disable-pip-version-check --no-deps "$EXECUTORCH_PIN"
  fi
}

build() {
  apt_deps
  python_env
  log "pip install --no-build-isolation -e .[test,docs] into $VENV (C++ build in $BUILD/; the first one takes minutes)"
  # Editable: Python files come from torch_opaque/, the compiled files are
  # installed in site-packages/torch_opaque (lib/, include/, the CMake package).
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    vpip install -q --disable-pip-version-check --no-build-isolation \
    -C build-dir="$BUILD" -C cmake.define.TORCH_OPAQUE_TESTS=ON -e ".[test,docs]"
  executorch_env
  local prefix
  prefix=$("$VENV/bin/python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
  log "examples/cpp against the installed CMake package ($BUILD/install)"
  examples/cpp/build_and_run.sh "$BUILD" "$prefix" --no-run >/dev/null
}

run_tests() {
  log "pytest"
  set +e
  # A test that needs ExecuTorch fails, not skips, when it is missing here.
  TORCH_OPAQUE_BUILD_DIR=$BUILD TORCH_OPAQUE_REQUIRE_EXECUTORCH=1 "$VENV/bin/python" -m pytest -q tests "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    return 1
  fi
  [ $rc -eq 0 ] || return $rc
  log "ctest"
  (cd "$BUILD" && ctest --output-on-failure)
}

docs() {
  log "sphinx-build -W docs $BUILD/docs"
  "$VENV/bin/python" -m sphinx -W --keep-going -q -b html -d "$BUILD/docs_doctrees" docs "$BUILD/docs"
  echo "open $BUILD/docs/index.html"
}

# ---- the release matrix (Note [The release matrix]) ---------------------------

# Starts, in the background, the environment of each release of RELEASES (its
# torch download, the build requirements); the pids go in PREPARING.
PREPARING=()
prepare_matrix() {
  local rel
  for rel in $RELEASES; do
    (select_release "$rel" matrix; mkdir -p "$BUILD"; python_env >"$BUILD/prepare.log" 2>&1) &
    PREPARING+=("$rel:$!")
  done
}

# Runs the function "$@" in a new run of this script (`__run`): unlike a
# function called in an `if` or a `||` list, whose commands bash runs with set
# -e off, it stops at its first failing command.
checked() { bash "$ROOT/scripts/dev.sh" __run "$@"; }

# Build, seed demo, the subset of the tests, CTest less `slow`, on release $1.
matrix_release() {
  local rel=$1 subset
  select_release "$rel" matrix
  build
  log "torch $rel: the seed demo"
  "$VENV/bin/python" examples/seed_demo.py
  mapfile -t subset < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' tests/release_subset.txt)
  log "torch $rel: pytest tests/release_subset.txt (${#subset[@]} files), under coverage"
  rm -f "$BUILD/release_subset.coverage"
  TORCH_OPAQUE_BUILD_DIR=$BUILD TORCH_OPAQUE_REQUIRE_EXECUTORCH=1 "$VENV/bin/python" -m coverage run \
    --data-file="$BUILD/release_subset.coverage" --source=torch_opaque -m pytest -q -p no:cacheprovider \
    "${subset[@]}"
  "$VENV/bin/python" scripts/check_release_coverage.py "$BUILD/release_subset.coverage"
  log "torch $rel: ctest -LE slow"
  (cd "$BUILD" && ctest -LE slow --output-on-failure)
}

# Every release of RELEASES, after prepare_matrix (or now); a summary line each.
run_matrix() {
  local rel entry pid start status rc=0 summary=() venvs=()
  [ -x "$ROOT/.venv/bin/python" ] && venvs+=("$ROOT/.venv")
  for rel in $RELEASES; do
    pid=""
    for entry in "${PREPARING[@]}"; do
      [ "${entry%%:*}" = "$rel" ] && pid=${entry#*:}
    done
    start=$SECONDS status=PASS
    if [ -n "$pid" ]; then
      log "torch $rel: waiting for its environment (log: $(select_release "$rel" matrix; echo "$BUILD")/prepare.log)"
      wait "$pid" || status=FAIL
    fi
    if [ $status = FAIL ] || ! checked matrix_release "$rel"; then status=FAIL rc=1; fi
    summary+=("torch $rel: $status ($(( (SECONDS - start) / 60 )) min)")
    [ $status = PASS ] && venvs+=("$(select_release "$rel" matrix; echo "$VENV")")
  done
  if ((${#venvs[@]} > 1)); then
    log "archives written under each release, loaded under the others (Note [Archives across releases])"
    start=$SECONDS status=PASS
    scripts/check_archive_compat.sh --across "${venvs[@]}" || status=FAIL rc=1
    summary+=("archives across $(( ${#venvs[@]} )) releases: $status ($(( (SECONDS - start) / 60 )) min)")
  fi
  if ((${#summary[@]})); then
    log "release matrix"
    printf '%s\n' "${summary[@]}"
  fi
  return $rc
}

build_and_test() { build; run_tests "$@"; }

cmd=${1:-test}
shift || true
select_release "${TORCH_OPAQUE_TORCH:-}"
case "$cmd" in
  build) build ;;
  demo) build; "$VENV/bin/python" examples/seed_demo.py ;;
  test)
    if (($#)) || [ -n "$TORCH_PIN" ]; then
      build; run_tests "$@"   # one release; pytest arguments as given
    else
      apt_deps
      prepare_matrix
      start=$SECONDS rc=0
      checked build_and_test || rc=$?
      log "the whole suite on torch $DEV_PIN: $( ((rc)) && echo FAIL || echo PASS) ($(( (SECONDS - start) / 60 )) min)"
      run_matrix || rc=1
      exit $rc
    fi ;;
  matrix) apt_deps; prepare_matrix; run_matrix ;;
  __run) "$@" ;;
  docs) build; docs ;;
  *) echo "usage: scripts/dev.sh demo|test|matrix|build|docs" >&2; exit 2 ;;
esac
