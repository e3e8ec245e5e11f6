"""Runs documentation examples the way a reader would, each page in a process of its own.

    python tests/doc_runner.py README.md docs/auto.md ...    # Markdown files' Python blocks
    python tests/doc_runner.py --pictures OUT docs/*.md      # ... and draw the pages' pictures
    python tests/doc_runner.py --module torch_opaque.passes  # a module's docstring examples

Markdown: every ```python block of a file runs, in order, in one namespace (as a
script ``__main__`` would); a block whose first line starts with ``>>>`` is a
doctest, so what it prints is checked; ``<!-- skip: next -->`` before a block
skips it (for blocks that need something the tests do not have, said next to
them). Each file runs in a process of its own, forked from one that has
imported torch, torch_opaque and a few modules several pages use
(Note [One process per page]).

``--pictures OUT``: after a page ran, the pictures drawn from its programs
(docs/pictures/make.py) are written into OUT.

Docstrings: ``doctest.testmod`` of the module, with ``__name__`` set to
``"__main__"`` as in a user's script.

Exit status 0 when every example ran as written; otherwise the file and line
of the first failing example of each failing file, and its error.
tests/test_docs.py calls this.
"""

from __future__ import annotations

import argparse
import doctest
import importlib
import importlib.util
import os
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Note [One process per page]: a page is read on its own, so its examples run in
# a namespace and a process of their own (ops are registered process-wide, and
# two pages may define classes of the same name, like the README's Foo). Each
# page runs in a child forked from a parent that has imported the modules
# below (the ones several pages import) and run nothing else, which saves each
# page the seconds of those imports; the child is what a fresh `python` that
# imports them first would be.
PRELOADED = ("torch", "torch._dynamo", "torch_opaque", "sybil", "torch_opaque.onnx", "onnxruntime")


def run_markdown(path: pathlib.Path, pictures: pathlib.Path | None = None) -> int:
    from sybil import Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

    document = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()]).parse(path)
    document.namespace["__name__"] = "__main__"
    # The examples' code objects carry the Markdown file's name (for line
    # numbers). Dynamo names the functions of a frame it traces by tokenizing
    # that file as Python (torch/_dynamo/funcname_cache.py), and tokenize can
    # raise IndentationError on Markdown, which torch does not catch: the file
    # is told to have no functions.
    from torch._dynamo import funcname_cache

    funcname_cache.cache[str(path)] = {}
    funcname_cache.cache[document.path] = {}
    count = 0
    for example in document:
        try:
            example.evaluate()
        except BaseException:  # noqa: BLE001 - reported with the example's line
            print(f"{path.name}:{example.line}: this example failed:", file=sys.stderr)
            traceback.print_exc()
            return 1
        count += 1
    print(f"{path.name}: {count} examples ran as written")
    if pictures is not None:
        for name in _picture_maker().draw(path.name, document.namespace, pictures):
            print(f"{path.name}: drew {name}")
    return 0 if count else 1


def _picture_maker():
    spec = importlib.util.spec_from_file_location("docs_pictures", ROOT / "docs/pictures/make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_pages(paths, pictures=None) -> int:
    """Each page in a forked child (Note [One process per page]); every page
    runs, the status is 1 if any failed."""
    for name in PRELOADED:
        importlib.import_module(name)

    failed = []
    for path in paths:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = run_markdown(path, pictures)
            except BaseException:  # noqa: BLE001 - reported, then the child ends
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(wait_status) != 0:
            failed.append(path.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def run_module(name: str) -> int:
    module = importlib.import_module(name)
    # Examples run as a user's script would: classes they define live in __main__.
    result = doctest.testmod(
        module,
        extraglobs={"__name__": "__main__"},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    print(f"{name}: {result.attempted} docstring examples, {result.failed} failed")
    return 1 if result.failed or not result.attempted else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="Markdown files, or a module name with --module")
    parser.add_argument("--module", action="store_true", help="run a module's docstrings")
    parser.add_argument("--pictures", metavar="OUT", help="also draw the pages' pictures into OUT")
    args = parser.parse_args(argv)
    if args.module:
        return max(run_module(name) for name in args.targets)
    pictures = pathlib.Path(args.pictures).resolve() if args.pictures else None
    if pictures is not None:
        pictures.mkdir(parents=True, exist_ok=True)
    return run_pages([pathlib.Path(t).resolve() for t in args.targets], pictures)


if __name__ == "__main__":
    sys.exit(main())
