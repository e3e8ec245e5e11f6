"""tests/release_subset.txt and its check (Note [What the release subset must
touch] in scripts/check_release_coverage.py), on the dev pin: the list names
existing test files, once each, and the check fails for a module whose
functions did not run, however much of it ran on import."""

import ast
import importlib.util
import pathlib

import coverage

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "release_subset.txt"


def _check_module():
    spec = importlib.util.spec_from_file_location("check_release_coverage", ROOT / "scripts" / "check_release_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entries() -> list:
    lines = (line.split("#", 1)[0].strip() for line in LIST.read_text().splitlines())
    return [line for line in lines if line]


def test_the_subset_names_existing_test_files_once():
    names = entries()
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name in names:
        path = ROOT / name
        assert path.is_file() and path.name.startswith("test_") and path.suffix == ".py", name
    # the files whose tests met a release difference (torch_opaque/_compat.py)
    assert {"tests/hooks/test_torchscript.py", "tests/hooks/test_apply_route.py", "tests/test_docs.py",
            "tests/archive/test_archive_corpus.py", "tests/archive/test_archive_fuzz.py",
            "tests/archive/test_archive_compat.py", "tests/test_aoti.py"} <= set(names)


def test_the_check_counts_function_bodies_not_imports(tmp_path, capsys):
    check = _check_module()
    source = "X = 1\n\ndef f():\n    return X\n\nclass C:\n    def m(self):\n        return 2\n"
    assert check.function_lines(ast.parse(source)) == {"f": {4}, "C.m": {8}}
    # coverage data in which every module ran only its import-time lines
    data = coverage.CoverageData(basename=str(tmp_path / "data"))
    lines = {}
    for path in check.PACKAGE.rglob("*.py"):
        inside = set().union(*check.function_lines(ast.parse(path.read_text())).values())
        lines[str(path)] = sorted(set(range(1, len(path.read_text().splitlines()) + 1)) - inside)
    data.add_lines(lines)
    data.write()
    assert check.main(str(tmp_path / "data")) == 1
    out = capsys.readouterr().out
    assert "torch_opaque/_compat.py (none of its" in out and "torch_opaque/_compat.py: " in out
