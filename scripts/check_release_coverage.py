"""Checks that a run of tests/release_subset.txt ran code of every torch_opaque module.

    python scripts/check_release_coverage.py COVERAGE_DATA_FILE

Note [What the release subset must touch]: on the releases other than the dev
pin, scripts/dev.sh runs a subset of the tests (Note [The release matrix]), so
a module that none of them runs would go untested there. The subset runs under
coverage (the parent pytest process; code run only in the fresh interpreters
that some tests start is not counted), and this check fails unless, for every
module of torch_opaque/, one line inside one of its functions ran: import-time
lines (the `def` and `class` statements, constants) do not count, since
importing torch_opaque runs them for every module. A module without functions
(only definitions) counts when it was imported. Every function of
torch_opaque/_compat.py must run: it holds the branches on the torch release
(Note [One place for each torch release difference] there).

A module whose functions only run in those fresh interpreters is named in
CHILD_ONLY with the test file that runs them, which must be in the subset.

Exit status 0 and one summary line when the subset touched everything;
otherwise the modules (and _compat functions) it did not touch.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import coverage

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torch_opaque"
COMPAT = PACKAGE / "_compat.py"
SUBSET = ROOT / "tests" / "release_subset.txt"
# module -> the test file whose fresh interpreters run its functions
CHILD_ONLY = {
    "torch_opaque/archive/own_ops.py": "tests/archive/test_archive_owned_ops.py",  # loads in new processes
}


def function_lines(tree: ast.AST) -> dict[str, set[int]]:
    """{qualified function name: the lines of its body's statements}."""
    out: dict[str, set[int]] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lines = out.setdefault(name, set())
                for stmt in child.body:
                    for sub in ast.walk(stmt):
                        if isinstance(sub, ast.stmt):
                            lines.add(sub.lineno)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def main(data_file: str) -> int:
    data = coverage.CoverageData(basename=data_file)
    data.read()
    measured = {pathlib.Path(f).resolve(): set(data.lines(f) or ()) for f in data.measured_files()}
    missing, uncalled = [], []
    modules = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    listed = {line.split("#", 1)[0].strip() for line in SUBSET.read_text().splitlines()}
    for path in modules:
        ran = measured.get(path.resolve())
        functions = function_lines(ast.parse(path.read_text(), str(path)))
        name = str(path.relative_to(ROOT))
        if name in CHILD_ONLY:
            if CHILD_ONLY[name] not in listed:
                missing.append(f"{name} (runs in the fresh interpreters of {CHILD_ONLY[name]}, not in the subset)")
            continue
        if ran is None:
            missing.append(f"{name} (not imported)")
        elif functions and not any(lines & ran for lines in functions.values()):
            missing.append(f"{name} (none of its {len(functions)} functions ran)")
        if path == COMPAT and ran is not None:
            uncalled += [f"{name}: {f}" for f, lines in functions.items() if lines and not lines & ran]
    if missing or uncalled:
        print("The release subset (tests/release_subset.txt) did not run code of:")
        for line in missing + uncalled:
            print("  " + line)
        print("Add a test file that exercises it to tests/release_subset.txt "
              "(Note [What the release subset must touch]).")
        return 1
    print(f"release subset: code of all {len(modules)} modules of torch_opaque ran, "
          f"every function of {COMPAT.relative_to(ROOT)} included")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
