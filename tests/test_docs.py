"""The README and the public docstrings run as written (tests/doc_runner.py),
each in a fresh process; C++ blocks of the README are copies of files that
CTest builds."""

import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import torch_opaque

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "doc_runner.py"


def _run(args, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(RUNNER), *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


def test_readme_python_blocks_run_as_written(tmp_path):
    # A reader runs the README from a checkout: files it writes land in a scratch
    # folder, paths into the build tree resolve through a link.
    (tmp_path / "build").symlink_to(ROOT / "build")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    out = _run([str(ROOT / "README.md")], tmp_path)
    assert re.search(r"README.md: \d+ examples ran as written", out), out


def _documented_modules():
    names = []
    for info in pkgutil.walk_packages(torch_opaque.__path__, "torch_opaque."):
        spec = info.module_finder.find_spec(info.name)
        origin = spec.origin if spec else None
        if origin and origin.endswith(".py") and ">>>" in pathlib.Path(origin).read_text():
            names.append(info.name)
    return sorted(names)


def test_public_modules_carry_docstring_examples():
    assert "torch_opaque._impl.function" in _documented_modules()


@pytest.mark.parametrize("module", _documented_modules())
def test_docstring_examples_run(module, tmp_path):
    out = _run(["--module", module], tmp_path)
    assert ", 0 failed" in out, out


def _fenced_blocks(text: str, language: str):
    for m in re.finditer(r"(<!--[^\n]*-->\n)?```" + language + r"\n(.*?)```", text, re.S):
        yield m.group(1) or "", m.group(2)


def test_readme_cpp_blocks_are_built_by_ctest():
    """Each C++/CMake block is a verbatim excerpt of a file the build compiles,
    unless a comment before it says why it is not run."""
    built = [
        *(ROOT / "examples").rglob("*.cpp"),
        *(ROOT / "examples").rglob("CMakeLists.txt"),
        *(ROOT / "benchmarks" / "cpp").glob("*.cpp"),
    ]
    sources = {p: p.read_text() for p in built}
    text = (ROOT / "README.md").read_text()
    for language in ("cpp", "cmake"):
        for marker, block in _fenced_blocks(text, language):
            if "not run" in marker:
                continue
            homes = [str(p.relative_to(ROOT)) for p, src in sources.items() if block in src]
            assert homes, f"README {language} block not found verbatim in a built file:\n{block}"
