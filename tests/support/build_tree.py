"""Where the C++ build tree of the torch_opaque under test is.

Note [One build tree per torch release]: scripts/dev.sh builds torch_opaque
once per tested torch release (Note [The release matrix] in scripts/dev.sh):
the dev pin in ``.venv`` with its build tree ``build/``, and each other release
X in ``.venv-torch-X`` with ``build-torch-X/``. The tests load libraries from
that tree (the examples' ops, the test ops of tests/cpp), so they must take the
tree the running interpreter's torch_opaque was built in, never another
release's. This module is the one place that says which it is:

1. ``TORCH_OPAQUE_BUILD_DIR`` when set (a relative path is taken from the
   repository root), for a build made another way;
2. ``build-torch-X`` when the interpreter runs from ``.venv-torch-X`` of this
   checkout;
3. ``build/`` otherwise.
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_PREFIX = ".venv-torch-"


def build_dir() -> pathlib.Path:
    """The C++ build tree of the torch_opaque this interpreter imports."""
    explicit = os.environ.get("TORCH_OPAQUE_BUILD_DIR")
    if explicit:
        return (ROOT / explicit).resolve()
    venv = pathlib.Path(sys.prefix).resolve()
    if venv.parent == ROOT and venv.name.startswith(VENV_PREFIX):
        return ROOT / ("build-torch-" + venv.name[len(VENV_PREFIX):])
    return ROOT / "build"


BUILD = build_dir()
# examples/cpp's ops library, built by scripts/dev.sh against the installed
# CMake package.
EXAMPLE_OPS_LIB = BUILD / "examples_cpp" / "libexample_ops.so"
# The libraries of tests/cpp/CMakeLists.txt.
TEST_LIBS = BUILD / "tests" / "cpp"


def missing(path: pathlib.Path) -> str:
    """The message of a test that finds a build output missing."""
    return f"{path} is missing: run scripts/dev.sh build first (build tree: {BUILD}; Note [One build tree per torch release])"
