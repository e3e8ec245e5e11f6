"""Importing the package: a compiled core that does not load gives an error that
says how to build it (not Python's "partially initialized module" message)."""

from support.processes import run_python

# A child process in which torch_opaque._C cannot be found, as in a source
# checkout that was never built.
CHILD = """
import importlib.abc, sys

class NoCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch_opaque._C":
            raise ModuleNotFoundError("No module named 'torch_opaque._C'", name=name)
        return None

sys.meta_path.insert(0, NoCore())
import torch_opaque
"""


def test_import_without_the_compiled_core_says_how_to_build():
    proc = run_python(CHILD)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: torch_opaque: its compiled core (torch_opaque._C) did not load: "
        "No module named 'torch_opaque._C'."
    ), last
    assert "pip install --no-build-isolation ." in last
