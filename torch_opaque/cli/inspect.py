"""``python -m torch_opaque inspect FILE [--graph OUT]``: the tables and pictures.

Lists the custom operators of a .pt2 archive (written by ``torch_opaque.save``
or plain ``torch.export.save``) or of an .onnx model, and optionally draws the
graph with those operators highlighted (Graphviz: .svg, .png, .dot, or a
self-contained .html page).

Inspecting never imports user code and runs nothing from the file: a .pt2 is
read as data within size limits (the torch_opaque manifest, through the same
reader as ``torch_opaque.load``, and the serialized graph JSON), never
deserialized or unpickled; an .onnx file is parsed with the ``onnx`` package.

Columns for a .pt2: the called operator, its schema (from the manifest; for
operators the manifest does not describe, inferred from the serialized call),
the number of calls, whether a decomposition is stored in the archive
(self-contained archives) and the autograd.Function that defines it. For an
.onnx model: every node whose domain is not '' / 'ai.onnx' / 'ai.onnx.ml', its
domain, input and output counts, calls, and whether ``model.functions``
holds a body for it.
"""

from __future__ import annotations

import argparse
import functools
import html
import os
import sys
import typing
from typing import Optional

from ..errors import ArchiveError, TorchOpaqueError
from ..archive.reader import json_nodes, read_archive
from ..archive.zipio import ArchiveLimits

STANDARD_ONNX_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


class InspectError(TorchOpaqueError):
    """A file ``inspect`` cannot read or draw; the message says why."""


# ---- tables ------------------------------------------------------------------------------------


def format_table(header: list, rows: list) -> str:
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


# ---- .pt2 ----------------------------------------------------------------------------------------

# The schema type named by each tag of torch's serialized Argument union
# (torch._export.serde.schema.Argument): the tags and their element types come
# from torch; only the element types' schema names are written here.
_ELEMENT_NAMES = {
    "TensorArgument": "Tensor",
    "OptionalTensorArgument": "Tensor?",
    "SymIntArgument": "SymInt",
    "SymFloatArgument": "SymFloat",
    "SymBoolArgument": "SymBool",
    "GraphArgument": "Graph",
    "CustomObjArgument": "CustomObj",
    "ComplexValue": "complex",
    "Device": "Device",
    "ScalarType": "ScalarType",
    "Layout": "Layout",
    "MemoryFormat": "MemoryFormat",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
}
_SPECIAL_TAGS = {"as_none": "None", "as_operator": "Operator"}  # a bool, a str in torch's union


def _type_name(t) -> str:
    if typing.get_origin(t) is list:
        return _type_name(typing.get_args(t)[0]) + "[]"
    if typing.get_origin(t) is dict:
        return "Dict"
    return _ELEMENT_NAMES.get(getattr(t, "__name__", ""), "?")


@functools.lru_cache(maxsize=None)
def _arg_types() -> dict:
    """Tag of torch's serialized Argument union -> schema type name."""
    from torch._export.serde import schema  # (here: `import torch_opaque` stays light)

    hints = typing.get_type_hints(schema.Argument)
    return {
        tag: _SPECIAL_TAGS.get(tag) or _type_name(t)
        for tag, t in hints.items()
        if tag.startswith("as_")
    }


def _arg_type(arg) -> str:
    if isinstance(arg, dict):
        types = _arg_types()
        for k, v in arg.items():
            if v is not None and k in types:
                return types[k]
    return "?"


def _inferred_schema(target: str, node: dict) -> str:
    _, _, ns, name, overload = target.split(".")
    args = ", ".join(f"{_arg_type(i.get('arg'))} {i.get('name', '?')}" for i in node["inputs"])
    outs = [_arg_type(o) for o in node["outputs"]]
    ret = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    return f"{ns}::{name}.{overload}({args}) -> {ret}"


def _first_nodes(contents) -> dict:
    first: dict = {}
    for model in contents.models.values():
        for node in json_nodes(model):
            t = node.get("target")
            if isinstance(t, str):
                first.setdefault(t, node)
    return first


def inspect_pt2(path: str, limits: Optional[ArchiveLimits] = None) -> str:
    contents = read_archive(path, limits)
    counts = contents.custom_targets()
    first = _first_nodes(contents)
    manifest = contents.manifest
    described: dict = {}  # "ns::Name[_fwd|_bwd].overload" -> (schema, stored, defined_by)
    if manifest is not None:
        for op in manifest.ops:
            by = f"{op.module}.{op.cls}" if op.module else "C++"
            for ov in op.overloads:
                stored = "yes (stored)" if ov.variants else "no"
                for suffix, schema, role in (
                    ("", ov.schema, "op"),
                    ("_fwd", ov.fwd_schema or ov.schema, "fwd"),
                    ("_bwd", ov.bwd_schema or ov.schema, "bwd"),
                ):
                    target = f"torch.ops.{op.namespace}.{op.name}{suffix}.{ov.overload}"
                    described[target] = (schema, stored, by, getattr(ov.calls, role))
    rows = []
    listed = {t for t in described if _manifest_calls(described[t], t) or _is_main(t)}
    for target in sorted(set(counts) | listed):
        _, _, ns, name, overload = target.split(".")
        if target in described:
            schema, stored, by, _ = described[target]
        else:
            node = first.get(target)
            schema = _inferred_schema(target, node) if node else "?"
            stored, by = "no", "?"
        rows.append([f"{ns}::{name}.{overload}", schema, str(counts.get(target, 0)), stored, by])
    if manifest is not None:
        kind = "torch_opaque archive" + (", self-contained" if manifest.self_contained else "")
        head = (
            f"{contents.path}: {kind} (saved with torch {manifest.torch_version}), "
            f"{len(manifest.ops)} opaque op(s)"
        )
    else:
        head = (
            f"{contents.path}: plain torch.export archive (no torch_opaque manifest; schemas "
            f"inferred from the serialized calls), {len(rows)} custom op(s)"
        )
    if not rows:
        return head + "\nno custom operators"
    table = format_table(["op", "schema", "calls", "decomposition", "defined by"], rows)
    return head + "\n" + table


def _is_main(target: str) -> bool:
    name = target.split(".")[3]
    return not (name.endswith("_fwd") or name.endswith("_bwd"))


def _manifest_calls(desc, target: str) -> int:
    return desc[3]


def _pt2_graph(path: str, limits: Optional[ArchiveLimits] = None):
    """(nodes, edges) of the first model: nodes are (id, label, kind)."""
    contents = read_archive(path, limits)
    if not contents.models:
        raise InspectError(f"{path} holds no serialized graph to draw")
    name = "model" if "model" in contents.models else sorted(contents.models)[0]
    model = contents.models[name]
    graph = model["graph_module"]["graph"]
    sig = model["graph_module"].get("signature", {})
    kinds = {}
    for spec in sig.get("input_specs", []):
        for k, v in spec.items():
            if isinstance(v, dict) and isinstance(v.get("arg"), dict):
                n = _names(v["arg"])
                for x in n:
                    kinds[x] = "param" if k != "user_input" else "input"
    opaque = set()
    if contents.manifest is not None:
        for op in contents.manifest.ops:
            for s in ("", "_fwd", "_bwd"):
                opaque.add(f"{op.namespace}.{op.name}{s}")
    nodes, edges, producer = [], [], {}
    for i, inp in enumerate(graph["inputs"]):
        for n in _names(inp):
            nid = f"in_{n}"
            nodes.append((nid, n, kinds.get(n, "input")))
            producer[n] = nid
    for k, node in enumerate(graph["nodes"]):
        target = node["target"]
        nid = f"n{k}"
        parts = target.split(".")
        if target.startswith("torch.ops.") and len(parts) == 5:
            ns = parts[2]
            label = f"{ns}::{parts[3]}.{parts[4]}" if ns not in ("aten", "prims") else parts[3]
            custom = ns not in ("aten", "prims", "higher_order")
            kind = "opaque" if f"{ns}.{parts[3]}" in opaque else ("custom" if custom else "op")
        else:
            label, kind = parts[-1], "op"
        nodes.append((nid, label, kind))
        for inp in node["inputs"]:
            for n in _names(inp.get("arg")):
                if n in producer:
                    edges.append((producer[n], nid))
        for out in node["outputs"]:
            for n in _names(out):
                producer[n] = nid
    nodes.append(("out", "output", "output"))
    for out in graph["outputs"]:
        for n in _names(out):
            if n in producer:
                edges.append((producer[n], "out"))
    return nodes, edges


def _names(arg) -> list:
    """Value names referenced by a serialized argument."""
    out = []
    stack = [arg]
    while stack:
        a = stack.pop()
        if isinstance(a, dict):
            for k, v in a.items():
                if k in ("name", "as_name") and isinstance(v, str):
                    out.append(v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(a, list):
            stack.extend(a)
    return out


# ---- .onnx ---------------------------------------------------------------------------------------


def _onnx_model(path: str):
    try:
        import onnx
    except ImportError as e:
        raise InspectError(f"reading .onnx files needs the 'onnx' package ({e})") from e
    try:
        return onnx.load(path, load_external_data=False)
    except Exception as e:
        raise InspectError(f"cannot read ONNX model {path}: {type(e).__name__}: {e}") from e


def _onnx_graph_nodes(graph):
    """Nodes of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _onnx_graph_nodes(attr.g)
            for g in attr.graphs:
                yield from _onnx_graph_nodes(g)


def _body(with_body: int, calls: int) -> str:
    if with_body == calls:
        return "yes"
    return "no" if with_body == 0 else f"{with_body} of {calls} calls"


def inspect_onnx(path: str) -> str:
    model = _onnx_model(path)
    # a FunctionProto is keyed by (domain, name, overload); overload is IR >= 10
    bodies = {(f.domain, f.name, getattr(f, "overload", "")) for f in model.functions}
    stats: dict = {}
    for node in _onnx_graph_nodes(model.graph):
        if node.domain in STANDARD_ONNX_DOMAINS:
            continue
        key = (node.domain, node.op_type)
        s = stats.setdefault(key, {"calls": 0, "bodies": 0, "ins": set(), "outs": set()})
        s["calls"] += 1
        s["bodies"] += (node.domain, node.op_type, getattr(node, "overload", "")) in bodies
        s["ins"].add(sum(1 for i in node.input if i))
        s["outs"].add(sum(1 for o in node.output if o))

    def span(values):
        lo, hi = min(values), max(values)
        return str(lo) if lo == hi else f"{lo}-{hi}"

    rows = [
        [
            op_type,
            domain,
            span(s["ins"]),
            span(s["outs"]),
            str(s["calls"]),
            _body(s["bodies"], s["calls"]),
        ]
        for (domain, op_type), s in sorted(stats.items())
    ]
    opsets = ", ".join(
        f"{o.domain or 'ai.onnx'} {o.version}" for o in sorted(model.opset_import, key=lambda o: o.domain)
    )
    head = (
        f"{path}: ONNX model (ir_version {model.ir_version}; opsets {opsets}), "
        f"{len(rows)} custom op(s)"
    )
    if not rows:
        return head + "\nno custom operators"
    table = format_table(["op", "domain", "inputs", "outputs", "calls", "function body"], rows)
    return head + "\n" + table


def _onnx_graph(path: str):
    model = _onnx_model(path)
    g = model.graph
    init = {i.name for i in g.initializer}
    nodes, edges, producer = [], [], {}
    for v in g.input:
        if v.name in init:
            continue
        nodes.append((f"in_{v.name}", v.name, "input"))
        producer[v.name] = f"in_{v.name}"
    for k, node in enumerate(g.node):
        nid = f"n{k}"
        custom = node.domain not in STANDARD_ONNX_DOMAINS
        label = f"{node.domain}::{node.op_type}" if custom else node.op_type
        nodes.append((nid, label, "custom" if custom else "op"))
        for i in node.input:
            if i in producer:
                edges.append((producer[i], nid))
        for o in node.output:
            if o:
                producer[o] = nid
    for v in g.output:
        nid = f"out_{v.name}"
        nodes.append((nid, v.name, "output"))
        if v.name in producer:
            edges.append((producer[v.name], nid))
    return nodes, edges


# ---- drawing --------------------------------------------------------------------------------------

_STYLE = {
    "opaque": {"shape": "box", "style": "filled,bold", "fillcolor": "#ffb347", "color": "#c05000"},
    "custom": {"shape": "box", "style": "filled,bold", "fillcolor": "#ffb347", "color": "#c05000"},
    "op": {"shape": "box", "style": "rounded"},
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#d9ecff"},
    "param": {"shape": "ellipse", "style": "filled", "fillcolor": "#eeeeee", "fontsize": "10"},
    "output": {"shape": "ellipse", "style": "filled", "fillcolor": "#d9f7d9"},
}


def _digraph(nodes, edges, title: str):
    try:
        import graphviz
    except ImportError as e:
        raise InspectError(f"--graph needs the 'graphviz' Python package ({e})") from e
    dot = graphviz.Digraph(name="graph", graph_attr={"label": title, "labelloc": "t"})
    for nid, label, kind in nodes:
        dot.node(nid, label, **_STYLE.get(kind, {}))
    for a, b in edges:
        dot.edge(a, b)
    return dot


def draw(path: str, out: str, kind: str, table: str, limits: Optional[ArchiveLimits] = None) -> None:
    nodes, edges = _onnx_graph(path) if kind == "onnx" else _pt2_graph(path, limits)
    dot = _digraph(nodes, edges, os.path.basename(path) + " (custom ops highlighted)")
    ext = os.path.splitext(out)[1].lower()
    if ext == ".dot" or ext == ".gv":
        with open(out, "w") as f:
            f.write(dot.source)
        return
    if ext not in (".svg", ".png", ".html", ".htm"):
        raise InspectError(f"--graph: unknown picture type '{ext}'; use .svg, .png, .html or .dot")
    import graphviz

    fmt = "png" if ext == ".png" else "svg"
    try:
        data = dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound as e:
        raise InspectError(
            f"--graph {ext} needs the Graphviz 'dot' program (Debian: apt-get install graphviz); "
            f"--graph FILE.dot works without it ({e})"
        ) from e
    if ext in (".html", ".htm"):
        svg = data.decode("utf-8")
        svg = svg[svg.find("<svg") :]
        page = (
            "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(os.path.basename(path))}</title>"
            "<style>body{font-family:sans-serif} pre{background:#f6f6f6;padding:8px}</style>"
            f"</head><body><h1>{html.escape(os.path.basename(path))}</h1>"
            f"<pre>{html.escape(table)}</pre>\n{svg}\n</body></html>\n"
        )
        data = page.encode("utf-8")
    with open(out, "wb") as f:
        f.write(data)


# ---- entry point --------------------------------------------------------------------------------


def _kind(path: str) -> str:
    """'onnx' for .onnx files and other non-zip files that start like an ONNX
    protobuf; 'pt2' otherwise (zip archives)."""
    if path.lower().endswith(".onnx"):
        return "onnx"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InspectError(f"cannot open {path}: {e}") from e
    return "onnx" if magic[:1] == b"\x08" else "pt2"  # ModelProto starts with ir_version


def inspect_file(path: str, graph: Optional[str] = None, limits: Optional[ArchiveLimits] = None) -> str:
    """The table of custom ops of a .pt2 or .onnx file (and its picture when
    ``graph`` names one); InspectError for anything unreadable."""
    if not os.path.exists(path):
        raise InspectError(f"{path}: no such file")
    kind = _kind(path)
    try:
        table = inspect_onnx(path) if kind == "onnx" else inspect_pt2(path, limits)
        if graph:
            draw(path, graph, kind, table, limits)
    except ArchiveError as e:
        raise InspectError(str(e)) from e
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        # a graph JSON whose shape is not torch's (the manifest is checked on reading)
        raise InspectError(
            f"torch_opaque: cannot inspect {path}: its serialized graph is malformed "
            f"({type(e).__name__}: {e})."
        ) from e
    return table
