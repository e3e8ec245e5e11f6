"""The core imports no integration (Note [Extension points] in
torch_opaque/_impl/extension_points.py): every import a core module makes, at
module level or inside a function, read with ``ast``, stays in the core."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torch_opaque"

# The core, and the foundations it stands on (the compiled extension, loaded by
# _native; the handling of torch release differences, _compat).
CORE = (
    "torch_opaque._impl",
    "torch_opaque.ops",
    "torch_opaque.errors",
    "torch_opaque.config",
    "torch_opaque._native",
)
ALLOWED = CORE + ("torch_opaque._C", "torch_opaque._compat")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list:
    """(line, module) of every import in ``source`` (the code of ``module``),
    relative ones resolved, ``from X import Y`` read as ``X.Y``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _core_files() -> list:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _within(_module_name(path), CORE):
            files.append(path)
    return files


def test_the_reader_sees_imports_inside_functions():
    source = "import os\ndef f():\n    from ..integrations import dynamo\n    from . import kernels\n"
    names = [n for _, n in imported_modules(source, "torch_opaque._impl.function")]
    assert names == ["os", "torch_opaque.integrations.dynamo", "torch_opaque._impl.kernels"]


def test_the_core_is_what_the_package_holds():
    names = {_module_name(p) for p in _core_files()}
    assert {"torch_opaque._impl.function", "torch_opaque._impl.extension_points", "torch_opaque.ops"} <= names
    assert not any(n.startswith("torch_opaque.integrations") for n in names)


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_core_module_imports_only_the_core(path):
    module = _module_name(path)
    wrong = [
        f"line {line}: {name}"
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py")
        if name.startswith("torch_opaque.") and not _within(name, ALLOWED)
    ]
    assert not wrong, (
        f"{path.relative_to(PACKAGE.parent)} is part of the core but imports "
        f"{', '.join(wrong)}, which is not: an integration attaches to the core through "
        f"torch_opaque/_impl/extension_points.py (wired in torch_opaque/integrations/__init__.py); "
        f"the core never imports it."
    )


def test_integrations_do_not_import_each_other_in_a_circle():
    """Each integration stands on the core (and on front ends it drives, such as
    torch_opaque.onnx); one may use another only one way round."""
    graph = {}
    for path in sorted((PACKAGE / "integrations").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = _module_name(path)
        graph[module] = {
            name.rpartition(".")[0] if name.rpartition(".")[0].startswith("torch_opaque.integrations.") else name
            for _, name in imported_modules(path.read_text(), module)
            if name.startswith("torch_opaque.integrations.")
        }
    for a, targets in graph.items():
        for b in targets:
            assert a not in graph.get(b, ()), f"{a} and {b} import each other"
