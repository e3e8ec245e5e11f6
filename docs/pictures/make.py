"""The pictures of the documentation, drawn by ``python -m torch_opaque inspect --graph``
from the programs the pages themselves build.

    .venv/bin/python docs/pictures/make.py          # redraw every picture into docs/pictures

Each picture of a program is drawn right after its page's Python blocks ran
(tests/doc_runner.py --pictures OUT calls draw() with the page's namespace), so
a picture shows exactly the program its page makes; call_path.svg and
layers.svg are call_path.dot and layers.dot rendered by Graphviz. tests/test_docs.py redraws them all into a
scratch folder and checks that they equal the files committed here.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _inspect_graph(program_file: pathlib.Path, out: pathlib.Path) -> None:
    from torch_opaque.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        status = main(["inspect", str(program_file), "--graph", str(out)])
    if status != 0:
        raise RuntimeError(f"python -m torch_opaque inspect {program_file} --graph {out} failed")


def _auto_program(ns, out: pathlib.Path) -> None:
    # docs/auto.md: CubeModel exported inside auto() (Cube an op, Clamp stock).
    import torch_opaque

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "cube_model.pt2"
        torch_opaque.save(ns["ep"], str(path))
        _inspect_graph(path, out)


def _training_step(ns, out: pathlib.Path) -> None:
    # docs/training.md saves its step as step.pt2 (self-contained) in the
    # current folder.
    _inspect_graph(pathlib.Path("step.pt2"), out)


def _onnx_model(ns, out: pathlib.Path) -> None:
    # docs/onnx.md exports FooModel to model.onnx in the current folder.
    _inspect_graph(pathlib.Path("model.onnx"), out)


PAGES = {
    "auto.md": {"auto_program.svg": _auto_program},
    "training.md": {"training_step.svg": _training_step},
    "onnx.md": {"onnx_model.svg": _onnx_model},
}
STATIC = {"call_path.svg": "call_path.dot", "layers.svg": "layers.dot"}


def draw(page: str, namespace: dict, outdir: pathlib.Path) -> list:
    """The pictures of `page`, drawn from its namespace after its blocks ran."""
    drawn = []
    for name, make in PAGES.get(page, {}).items():
        make(namespace, outdir / name)
        drawn.append(name)
    return drawn


def draw_static(outdir: pathlib.Path) -> list:
    """The pictures drawn from hand-written Graphviz sources."""
    for name, source in STATIC.items():
        svg = subprocess.run(
            ["dot", "-Tsvg", str(HERE / source)], check=True, capture_output=True
        ).stdout
        (outdir / name).write_bytes(svg)
    return list(STATIC)


def pages() -> list:
    return [ROOT / "docs" / page for page in PAGES]


def main() -> int:
    draw_static(HERE)
    runner = ROOT / "tests" / "doc_runner.py"
    return subprocess.call(
        [sys.executable, str(runner), "--pictures", str(HERE), *map(str, pages())],
        cwd=tempfile.mkdtemp(prefix="docs_pictures_"),
    )


if __name__ == "__main__":
    sys.exit(main())
