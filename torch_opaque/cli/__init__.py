"""The ``python -m torch_opaque`` command line; ``inspect`` lists and draws the
custom ops of a .pt2 or .onnx file without importing or running anything from it
(see torch_opaque/cli/inspect.py)."""

from __future__ import annotations

import argparse
import sys

from ..archive.zipio import ArchiveLimits
from .inspect import InspectError, inspect_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_opaque",
        description="Tools for programs with torch_opaque operators.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "inspect",
        help="list the custom ops of a .pt2 or .onnx file (imports no user code)",
        description="List the custom operators of a .pt2 archive or an .onnx model.",
    )
    p.add_argument("file", help="a .pt2 (torch_opaque.save / torch.export.save) or .onnx file")
    p.add_argument(
        "--graph",
        metavar="OUT",
        help="also draw the graph, custom ops highlighted: OUT.svg, .png, .html or .dot",
    )
    p.add_argument(
        "--max-size",
        metavar="BYTES",
        type=int,
        help="read .pt2 manifests and graphs up to this size (default: ArchiveLimits)",
    )
    p.add_argument(
        "--max-nodes",
        metavar="N",
        type=int,
        help="draw --graph pictures (.svg/.png/.html) of up to N nodes (default: 1000)",
    )
    args = parser.parse_args(argv)
    limits = None
    if args.max_size or args.max_nodes:
        fields = {}
        if args.max_size:
            fields.update(manifest=args.max_size, model=args.max_size, other=args.max_size)
        if args.max_nodes:
            fields.update(picture_nodes=args.max_nodes, nodes=max(args.max_nodes, ArchiveLimits.nodes))
        try:
            limits = ArchiveLimits(**fields)
        except ValueError as e:
            parser.error(str(e))
    try:
        print(inspect_file(args.file, args.graph, limits))
    except InspectError as e:
        print(f"python -m torch_opaque inspect: error: {e}", file=sys.stderr)
        return 1
    if args.graph:
        print(f"graph written to {args.graph}")
    return 0
