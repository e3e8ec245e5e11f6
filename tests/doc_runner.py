"""Runs documentation examples the way a reader would, in a process of their own.

    python tests/doc_runner.py README.md              # a Markdown file's Python blocks
    python tests/doc_runner.py --module torch_opaque.passes   # a module's docstring examples

Markdown: every ```python block runs, in order, in one namespace (as a script
``__main__`` would); a block whose first line starts with ``>>>`` is a doctest,
so what it prints is checked; ``<!-- skip: next -->`` before a block skips it
(for blocks that need something the tests do not have, said next to them).
Docstrings: ``doctest.testmod`` of the module, with ``__name__`` set to
``"__main__"`` as in a user's script.

Exit status 0 when every example ran as written; otherwise the file and line
of the first failing example and its error. tests/test_docs.py calls this.
"""

from __future__ import annotations

import argparse
import doctest
import importlib
import pathlib
import sys
import traceback


def run_markdown(path: pathlib.Path) -> int:
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
    return 0 if count else 1


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
    parser.add_argument("target", help="a Markdown file, or a module name with --module")
    parser.add_argument("--module", action="store_true", help="run a module's docstrings")
    args = parser.parse_args(argv)
    if args.module:
        return run_module(args.target)
    return run_markdown(pathlib.Path(args.target).resolve())


if __name__ == "__main__":
    sys.exit(main())
