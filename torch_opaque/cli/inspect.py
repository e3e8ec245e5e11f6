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

Every operator the serialized graphs call follows, aten, prims and
higher-order ops included, with the number of calls and of times it is passed
to another call as an argument (``as_operator``, e.g. the op a higher-order
``auto_functionalized`` runs): what ``torch_opaque.load`` would run is all
listed, not only the custom operators.

Note [Strings from the file are shown escaped]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A file is data: nothing in it may act on the user's terminal or browser. Every
string ``inspect`` prints or draws that comes from the inspected file (targets,
op and value names, schemas, module and class names, versions, ONNX domains,
and error messages quoting any of them) goes through :func:`printable`, which
writes each character ``str.isprintable`` rejects as the escape of its code
point (``\\x1b``, ``\\x0d``, ``\\u202e``, ``\\U000e0041``): C0 and C1 controls
(ESC starting an escape sequence or OSC 8 hyperlink, BEL, carriage return,
newline), format characters (bidi overrides, zero-width), line and paragraph
separators, surrogates, unassigned code points and non-ASCII spaces. So no
escape sequence reaches the terminal, no file string breaks or overwrites a
line or reorders the text around it, and the escape stays visible to the
reader. Printable names, the ones torch writes, print unchanged. The tables
escape every cell (:func:`format_table`); headers and error messages escape
each piece they quote, paths included (a file name is data too).

The picture follows the same rule and one more: Graphviz reads a label
``<...>`` as an HTML-like label, whose ``HREF`` becomes a live link in an SVG.
So every label is a plain DOT string (:func:`_dot_label`: escaped, then
``graphviz.escape``, which marks it as never HTML-like and makes its
backslashes literal), node ids are ``inspect``'s own (``n0``, ``in_0``), no
URL/href/tooltip attribute is ever set, and the .html page escapes its own text
with ``html.escape`` (dot escapes the SVG's text).
"""

from __future__ import annotations

import argparse
import functools
import html
import json
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


# ---- escaping (Note [Strings from the file are shown escaped]) -----------------------------------


def printable(s) -> str:
    """``s`` with every character ``str.isprintable`` rejects (all but the space)
    written as the escape of its code point: ``'a\\x1b[2Jb'`` prints as ``a\\x1b[2Jb``.
    Printable text is returned unchanged; the result is printable, one line."""
    s = str(s)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape_char(c) for c in s)


def _escape_char(c: str) -> str:
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


# ---- tables ------------------------------------------------------------------------------------


def format_table(header: list, rows: list) -> str:
    """Aligned columns; every cell shown through :func:`printable`."""
    cols = [[printable(c) for c in r] for r in [header] + rows]
    header, rows = cols[0], cols[1:]
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
    return _custom_ops_section(contents) + "\n\n" + _all_operators_section(contents)


def _custom_ops_section(contents) -> str:
    """The header line and the table of custom operators."""
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
    where = printable(contents.path)
    if manifest is not None:
        kind = "torch_opaque archive" + (", self-contained" if manifest.self_contained else "")
        head = (
            f"{where}: {kind} (saved with torch {printable(manifest.torch_version)}), "
            f"{len(manifest.ops)} opaque op(s)"
        )
    else:
        head = (
            f"{where}: plain torch.export archive (no torch_opaque manifest; schemas "
            f"inferred from the serialized calls), {len(rows)} custom op(s)"
        )
    if not rows:
        return head + "\nno custom operators"
    table = format_table(["op", "schema", "calls", "decomposition", "defined by"], rows)
    return head + "\n" + table


def _all_operators_section(contents) -> str:
    """Every operator the serialized graphs call or pass as an argument, aten /
    prims / higher-order ops included (what loading the archive would run)."""
    uses = operator_uses(contents)
    head = f"all operators called ({len(uses)} distinct; aten, prims and higher-order included)"
    if not uses:
        return head + "\nno operator calls"
    rows = [[t, str(calls), str(as_arg)] for t, (calls, as_arg) in sorted(uses.items())]
    return head + "\n" + format_table(["operator", "calls", "passed as argument"], rows)


def operator_uses(contents) -> dict:
    """Serialized target -> [calls, times passed as an ``as_operator`` argument],
    over every node of every serialized graph (nested graphs included)."""
    uses: dict = {}
    for model in contents.models.values():
        for node in json_nodes(model):
            uses.setdefault(_target_text(node["target"]), [0, 0])[0] += 1
            for inp in node["inputs"]:
                arg = inp.get("arg") if isinstance(inp, dict) else None
                op = arg.get("as_operator") if isinstance(arg, dict) else None
                if op is not None:
                    uses.setdefault(_target_text(op), [0, 0])[1] += 1
    return uses


def _target_text(target) -> str:
    """A serialized target as listed: the string itself, anything else (a
    malformed graph) as its JSON."""
    return target if isinstance(target, str) else json.dumps(target)


def _is_main(target: str) -> bool:
    name = target.split(".")[3]
    return not (name.endswith("_fwd") or name.endswith("_bwd"))


def _manifest_calls(desc, target: str) -> int:
    return desc[3]


def _pt2_graph(path: str, limits: Optional[ArchiveLimits] = None):
    """(nodes, edges) of the first model: nodes are (id, label, kind)."""
    contents = read_archive(path, limits)
    if not contents.models:
        raise InspectError(f"{printable(path)} holds no serialized graph to draw")
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
            nid = f"in_{len(nodes)}"  # inspect's own id (Note [Strings from the file are shown escaped])
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
        raise InspectError(
            f"cannot read ONNX model {printable(path)}: {type(e).__name__}: {printable(e)}"
        ) from e


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
        f"{printable(path)}: ONNX model (ir_version {model.ir_version}; opsets {printable(opsets)}), "
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
    for k, v in enumerate(g.input):
        if v.name in init:
            continue
        nodes.append((f"in_{k}", v.name, "input"))  # inspect's own ids, never a name from the file
        producer[v.name] = f"in_{k}"
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
    for k, v in enumerate(g.output):
        nid = f"out_{k}"
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


def _dot_label(text: str) -> str:
    """A plain DOT string label showing ``text``: escaped (Note [Strings from the
    file are shown escaped]), never HTML-like, its backslashes literal."""
    import graphviz

    return graphviz.escape(printable(text))


def _digraph(nodes, edges, title: str):
    try:
        import graphviz
    except ImportError as e:
        raise InspectError(f"--graph needs the 'graphviz' Python package ({e})") from e
    dot = graphviz.Digraph(name="graph", graph_attr={"label": _dot_label(title), "labelloc": "t"})
    for nid, label, kind in nodes:
        dot.node(nid, _dot_label(label), **_STYLE.get(kind, {}))
    for a, b in edges:
        dot.edge(a, b)
    return dot


def draw(path: str, out: str, kind: str, table: str, limits: Optional[ArchiveLimits] = None) -> None:
    nodes, edges = _onnx_graph(path) if kind == "onnx" else _pt2_graph(path, limits)
    dot = _digraph(nodes, edges, os.path.basename(path) + " (custom ops highlighted)")
    ext = os.path.splitext(out)[1].lower()
    if ext == ".dot" or ext == ".gv":
        with open(out, "w", encoding="utf-8") as f:
            f.write(dot.source)
        return
    if ext not in (".svg", ".png", ".html", ".htm"):
        raise InspectError(
            f"--graph: unknown picture type '{printable(ext)}'; use .svg, .png, .html or .dot"
        )
    # Note [Pictures of huge graphs]: Graphviz's layout time grows with about
    # the square of the nodes (a 50,000-node program ran past 100 s), so a
    # picture is drawn for at most ArchiveLimits.picture_nodes nodes (1000:
    # 0.2 CPU-s of dot, 2000: 0.6 s); .dot output (no layout) is written whole.
    most = (limits or ArchiveLimits()).picture_nodes
    if len(nodes) > most:
        raise InspectError(
            f"--graph {ext}: the graph of {printable(path)} has {len(nodes)} nodes, more than the "
            f"{most} a picture is drawn for (laying it out takes time that grows with the "
            f"square of the nodes); pass --max-nodes {len(nodes)} to draw it anyway, or write "
            f"--graph FILE.dot (no layout). The table above lists every operator."
        )
    fmt = "png" if ext == ".png" else "svg"
    data = _render(dot, fmt, path, ext)
    if ext in (".html", ".htm"):
        data = _html_page(path, table, data.decode("utf-8")).encode("utf-8")
    with open(out, "wb") as f:
        f.write(data)


def _render(dot, fmt: str, path: str, ext: str) -> bytes:
    """The picture from Graphviz's ``dot``; its messages, which may quote labels,
    are shown escaped in the error when it fails and dropped otherwise."""
    import graphviz

    try:
        return dot.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound as e:
        raise InspectError(
            f"--graph {ext} needs the Graphviz 'dot' program (Debian: apt-get install graphviz); "
            f"--graph FILE.dot works without it ({e})"
        ) from e
    except graphviz.CalledProcessError as e:
        why = e.stderr.decode("utf-8", "replace") if isinstance(e.stderr, bytes) else str(e.stderr)
        raise InspectError(
            f"--graph {ext}: Graphviz 'dot' failed on the graph of {printable(path)} "
            f"(exit status {e.returncode}: {printable(why.strip())}); --graph FILE.dot writes "
            f"the graph's source without running dot"
        ) from e


def _html_page(path: str, table: str, svg: str) -> str:
    """A self-contained page: the table and the picture. Its own text is
    html-escaped; the SVG's text dot escaped (Note [Strings from the file are
    shown escaped])."""
    svg = svg[svg.find("<svg") :]
    name = html.escape(printable(os.path.basename(path)))
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{name}</title>"
        "<style>body{font-family:sans-serif} pre{background:#f6f6f6;padding:8px}</style>"
        f"</head><body><h1>{name}</h1>"
        f"<pre>{html.escape(table)}</pre>\n{svg}\n</body></html>\n"
    )


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
        raise InspectError(f"cannot open {printable(path)}: {printable(e)}") from e
    return "onnx" if magic[:1] == b"\x08" else "pt2"  # ModelProto starts with ir_version


def inspect_file(path: str, graph: Optional[str] = None, limits: Optional[ArchiveLimits] = None) -> str:
    """The table of custom ops of a .pt2 or .onnx file (for a .pt2, then the
    list of every operator called) and its picture when ``graph`` names one;
    every string from the file escaped (Note [Strings from the file are shown
    escaped]); InspectError for anything unreadable."""
    if not os.path.exists(path):
        raise InspectError(f"{printable(path)}: no such file")
    kind = _kind(path)
    try:
        table = inspect_onnx(path) if kind == "onnx" else inspect_pt2(path, limits)
        if graph:
            draw(path, graph, kind, table, limits)
    except ArchiveError as e:
        raise InspectError(printable(e)) from e  # it may quote the file
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        # a graph JSON whose shape is not torch's (the manifest is checked on reading)
        raise InspectError(
            f"torch_opaque: cannot inspect {printable(path)}: its serialized graph is malformed "
            f"({type(e).__name__}: {printable(e)})."
        ) from e
    return table
