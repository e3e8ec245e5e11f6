"""``inspect`` of crafted files: Note [Strings from the file are shown escaped]
in torch_opaque/cli/inspect.py (no string from the file acts on the terminal or
makes a live link in a picture), and the listing of every operator the graphs
call, aten included."""

import html.parser
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

import torch_opaque
from archive_corpus import edit_json, first_node_target, manifest_of, rewrite, root_of, stored, with_manifest
from opaque_fixtures import archops
from support.processes import run_python
from torch_opaque.cli.inspect import InspectError, inspect_file, printable

HAVE_DOT = shutil.which("dot") is not None

# An escape sequence clearing the screen, an OSC 8 hyperlink, BEL, a carriage
# return that would overwrite the line, a bidi override and a C1 CSI.
EVIL = "\x1b[2J\x1b]8;;https://evil.example/\x07click\x1b]8;;\x07\rfake\u202eesrever\x9b31m"
# A label Graphviz reads as HTML, with a javascript: link.
HTML_LINK = '<<TABLE><TR><TD HREF="javascript:alert(1)">x</TD></TR></TABLE>>'


def raw_controls(text: str) -> list:
    """The characters of `text` a terminal could act on (line breaks aside)."""
    return sorted({c for c in text if not c.isprintable() and c != "\n"})


def assert_terminal_safe(text: str, where: str) -> None:
    bad = raw_controls(text)
    assert not bad, (
        f"{where} passes {bad!r} from the file raw to the terminal; every file string "
        f"must go through torch_opaque.cli.inspect.printable():\n{text!r}"
    )


def inspect_in_process(path, *graph) -> str:
    """The table, or the error message (what the command would print)."""
    try:
        return inspect_file(str(path), *graph)
    except InspectError as e:
        return str(e)


def inspect_command(path, tmp_path, *extra):
    return run_python(module="torch_opaque", args=["inspect", path, *extra], cwd=tmp_path, timeout=300)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    path = tmp_path_factory.mktemp("escaping") / "net.pt2"
    torch_opaque.save(archops.export_net(), path)
    return path


def edit_first_nodes(model: dict) -> None:
    """An aten target with an escape sequence after it; the Cube call renamed
    with a bidi override and its argument named with a carriage return."""
    first_node_target(model)["target"] = "torch.ops.aten.add.Tensor\x1b[2J"
    for n in model["graph_module"]["graph"]["nodes"]:
        if n["target"] == "torch.ops.opaque.ArchCube.Tensor":
            n["target"] = "torch.ops.opaque.ArchCube\u202e.Tensor"
            n["inputs"][0]["name"] = "x\rOVERWRITTEN"


@pytest.fixture(scope="module")
def crafted(net):
    """torch_version, a stored schema and graph targets / names carry EVIL."""
    m = manifest_of(net)
    m["torch_version"] = EVIL
    cube = next(op for op in m["ops"] if op["name"] == "ArchCube")
    ov = cube["overloads"][0]
    ov["fwd_schema"] = "opaque::ArchCube_fwd.Tensor(Tensor x) -> Tensor" + EVIL
    ov["calls"]["fwd"] = 1  # so the _fwd row, with its schema, is listed
    step = net.with_name("step.pt2")
    with_manifest(net, step, m)
    out = net.with_name("crafted.pt2")
    rewrite(step, out, edit_json("models/model.json", edit_first_nodes))
    return out


def assert_escaped_table(out: str) -> None:
    assert_terminal_safe(out, "inspect's table")
    assert f"(saved with torch {printable(EVIL)})" in out, out
    assert "\\x1b[2J\\x1b]8;;https://evil.example/\\x07click" in out and "\\u202eesrever\\x9b31m" in out
    assert "-> Tensor" + printable(EVIL) in out, "the stored _fwd schema, escaped"
    assert "opaque::ArchCube\\u202e.Tensor(Tensor x\\x0dOVERWRITTEN) -> Tensor" in out, out
    assert "torch.ops.aten.add.Tensor\\x1b[2J" in out, "the aten target, in the all-operators listing"
    # no file string breaks a line: the header and each table row stay one line
    (head,) = [l for l in out.splitlines() if "saved with torch" in l]
    assert head.endswith("3 opaque op(s)"), head


def test_file_strings_are_escaped_in_the_table(crafted):
    assert_escaped_table(inspect_in_process(crafted))


def test_file_strings_are_escaped_by_the_command(crafted, tmp_path):
    proc = inspect_command(crafted, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stderr, "stderr")
    assert_escaped_table(proc.stdout)


@pytest.mark.parametrize(
    "field, value",
    [
        ("module", "opaque_fixtures.archops\n"),  # a trailing newline the name pattern lets through
        ("module", "opaque_fixtures\x1b[2J.archops"),
        ("class", "Cube\n"),
        ("class", "Cube\x1b]8;;javascript:alert(1)\x07x\x1b]8;;\x07"),
        ("class", "Cube\u202e"),
    ],
)
def test_manifest_names_are_escaped(net, tmp_path, field, value):
    """Shown escaped in the table, or quoted escaped by the error refusing them."""
    m = manifest_of(net)
    next(op for op in m["ops"] if op["name"] == "ArchCube")[field] = value
    path = tmp_path / "names.pt2"
    with_manifest(net, path, m)
    out = inspect_in_process(path)
    assert_terminal_safe(out, f"inspect of a manifest whose {field} is {value!r}")
    assert printable(value) in out or repr(value)[1:-1] in out, out
    if "ArchCube.Tensor(" in out:  # accepted: the op's row stays one line
        (row,) = [l for l in out.splitlines() if l.startswith("opaque::ArchCube.Tensor ")]
        assert printable(value) in row, out


def test_error_quoting_an_entry_name_is_escaped(net, tmp_path):
    """A size-limit error names the entry; the name is the file's."""
    name = "models/evil\x1b]8;;https:evil.example\x07.json"  # read as a model (no '/' in it)
    path = tmp_path / "big_entry.pt2"
    rewrite(net, path, lambda n, d: d, add=[stored(root_of(net) + name, b" " * (2 << 20))])
    proc = inspect_command(path, tmp_path, "--max-size", str(1 << 20))
    assert proc.returncode == 1, proc.stdout
    assert_terminal_safe(proc.stdout + proc.stderr, "the error message")
    assert "evil\\x1b]8;;https:evil.example\\x07.json" in proc.stderr, proc.stderr
    assert "inflates to" in proc.stderr and "ArchiveLimits" in proc.stderr, proc.stderr


def test_file_name_is_escaped(net, tmp_path):
    evil = tmp_path / "net\x1b[2J\r.pt2"
    evil.write_bytes(net.read_bytes())
    out = inspect_in_process(evil)
    assert_terminal_safe(out, "the header naming the file")
    assert "net\\x1b[2J\\x0d.pt2: torch_opaque archive" in out, out
    missing = inspect_in_process(tmp_path / "gone\x1b[2J.pt2")
    assert_terminal_safe(missing, "the 'no such file' error")
    assert missing.endswith("gone\\x1b[2J.pt2: no such file"), missing


def test_onnx_names_are_escaped(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    node = helper.make_node("Op\r\u202e", ["x"], ["y"], domain="com.evil\x1b[2J")
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.evil\x1b[2J", 1)],
    )
    path = tmp_path / "evil.onnx"
    onnx.save(model, str(path))
    out = inspect_in_process(path)
    assert_terminal_safe(out, "inspect of an .onnx model")
    assert "Op\\x0d\\u202e" in out and "com.evil\\x1b[2J" in out, out
    assert "opsets ai.onnx 18, com.evil\\x1b[2J 1)" in out, out


# ---- pictures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def html_labelled(net):
    """The first aten call's target is an HTML-like label with a javascript: link."""

    def edit(model):
        first_node_target(model)["target"] = HTML_LINK

    out = net.with_name("html_label.pt2")
    rewrite(net, out, edit_json("models/model.json", edit))
    return out


class _Markup(html.parser.HTMLParser):
    """Tags, attributes and text of an HTML (or SVG) document."""

    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [name for name, _ in attrs]

    def handle_data(self, data):
        self.text.append(data)


def assert_no_live_link(markup: str, where: str) -> None:
    m = _Markup()
    m.feed(markup)
    links = [t for t in m.tags if t in ("a", "script", "iframe", "object", "foreignobject")]
    live = [a for a in m.attrs if a.endswith("href") or a.startswith("on")]
    assert not links and not live, (
        f"{where}: a label from the file became markup ({links + live}); labels must be plain "
        f"escaped DOT strings (graphviz.escape), never HTML-like"
    )
    assert "javascript:alert(1)" in "".join(m.text), f"{where}: the label is not shown as text"


@pytest.mark.skipif(not HAVE_DOT, reason="needs Graphviz's 'dot' program (Debian package graphviz)")
@pytest.mark.parametrize("ext", [".svg", ".html"])
def test_html_like_target_makes_no_link(html_labelled, tmp_path, ext):
    out = tmp_path / ("graph" + ext)
    inspect_file(str(html_labelled), str(out))
    text = out.read_text(encoding="utf-8")
    if ext == ".svg":
        ET.fromstring(text)  # well-formed
    assert_no_live_link(text, f"--graph {ext}")


def test_dot_labels_are_plain_strings(html_labelled, crafted, tmp_path):
    """In the DOT source every label is quoted ("..."), never <...>, and shows
    no raw control character (works without the dot program)."""
    for source in (html_labelled, crafted):
        out = tmp_path / "graph.dot"
        inspect_file(str(source), str(out))
        text = out.read_text(encoding="utf-8")
        assert "label=<" not in text, text
        assert_terminal_safe(text.replace("\n\t", "\n"), "the DOT source")  # (its own indent aside)
    assert 'label="opaque::ArchCube\\\\u202e.Tensor"' in text, text  # escaped, backslash literal


def test_dot_failure_is_reported_escaped(net, tmp_path, monkeypatch):
    """dot's own messages may quote labels: an error shows them escaped."""
    import graphviz

    def fail(self, *args, **kwargs):
        raise graphviz.CalledProcessError(1, ["dot"], output=b"", stderr=b"Error: label \x1b[2J\rfake\n")

    monkeypatch.setattr(graphviz.Digraph, "pipe", fail)
    msg = inspect_in_process(net, str(tmp_path / "g.svg"))
    assert_terminal_safe(msg, "the error of a failed dot run")
    assert "Graphviz 'dot' failed" in msg and "label \\x1b[2J\\x0dfake)" in msg, msg
    assert "--graph FILE.dot" in msg


# ---- every operator ------------------------------------------------------------------------------


def all_operators(table: str) -> dict:
    """The all-operators section of inspect's output: operator -> (calls, as argument)."""
    lines = table.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("all operators called"))
    assert lines[start + 1].split() == ["operator", "calls", "passed", "as", "argument"]
    rows = [l.split() for l in lines[start + 3 :]]
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


class SinCos(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,)) + 1


def test_aten_and_higher_order_calls_are_listed(tmp_path):
    """A plain archive with no custom op: inspect once said only 'no custom
    operators'. Calls in nested graphs (cond's branches) count too."""
    path = tmp_path / "sincos.pt2"
    torch.export.save(torch.export.export(SinCos(), (torch.randn(3),)), path)
    table = inspect_file(str(path))
    assert "no custom operators" in table
    assert all_operators(table) == {
        "torch.ops.aten.add.Tensor": (1, 0),
        "torch.ops.aten.cos.default": (1, 0),
        "torch.ops.aten.gt.Scalar": (1, 0),
        "torch.ops.aten.sin.default": (1, 0),
        "torch.ops.aten.sum.default": (1, 0),
        "torch.ops.higher_order.cond": (1, 0),
    }
    assert "all operators called (6 distinct; aten, prims and higher-order included)" in table


def test_aten_target_planted_in_an_archive_is_listed(net, tmp_path):
    """What a vetting reader must see: an aten op (aten::from_file) in the graph."""

    def plant(model):
        first_node_target(model)["target"] = "torch.ops.aten.from_file.default"

    path = tmp_path / "from_file.pt2"
    rewrite(net, path, edit_json("models/model.json", plant))
    ops = all_operators(inspect_file(str(path)))
    assert ops["torch.ops.aten.from_file.default"] == (1, 0), ops
    assert ops["torch.ops.opaque.ArchCube.Tensor"] == (1, 0)


@torch.library.custom_op("inspect_escaping::bump", mutates_args=("x",))
def bump(x: torch.Tensor) -> None:
    x.add_(1)


class Bumps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        bump(self.b)
        return x + self.b


def test_operator_passed_as_argument_is_listed(tmp_path):
    """A mutating custom op runs through auto_functionalized, which takes it as
    an argument (as_operator), not as a node target."""
    path = tmp_path / "bumps.pt2"
    ep = torch.export.export(Bumps(), (torch.randn(3),)).run_decompositions({})
    torch.export.save(ep, path)
    ops = all_operators(inspect_file(str(path)))
    assert ops["torch.ops.inspect_escaping.bump.default"] == (0, 1), ops
    hop = [t for t in ops if t.startswith("torch.ops.higher_order.auto_functionalized")]
    assert hop and ops[hop[0]] == (1, 0), ops


def test_as_operator_argument_is_escaped(net, tmp_path):
    def plant(model):
        arg = {"as_operator": "torch.ops.x\x1b[2J.y.z"}
        first_node_target(model)["inputs"].append({"name": "op", "arg": arg})

    path = tmp_path / "as_operator.pt2"
    rewrite(net, path, edit_json("models/model.json", plant))
    table = inspect_in_process(path)
    assert_terminal_safe(table, "the all-operators listing")
    assert all_operators(table)["torch.ops.x\\x1b[2J.y.z"] == (0, 1), table


def test_printable_leaves_ordinary_text_alone():
    ordinary = ("torch.ops.aten.add.Tensor", "opaque::Op.Tensor(Tensor x, float s=1.5) -> Tensor", "é 日本")
    for s in ordinary:
        assert printable(s) == s
    assert printable("a\x1b[2J\r\n\u202e\u2028\x85\x9b\t\U000e0041b") == (
        "a\\x1b[2J\\x0d\\x0a\\u202e\\u2028\\x85\\x9b\\x09\\U000e0041b"
    )
    assert printable(printable("\x1b")) == "\\x1b"
