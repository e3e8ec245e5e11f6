"""A loaded program can do only what its signature declares (issue #35):
crafted archives of the stored call graph, the zip container, symbolic
expressions and pictures, archive versions, and concurrent loads.

Every case that loads and runs a program runs in a child process
(tests/support/scripts/load_cases.py), so a crash fails the test; archives
refused while reading are read in this process. Work is bounded by counts and
CPU time with wide margins, never by wall-clock time.
"""

import io
import json
import resource
import struct
import zipfile
import zlib

import pytest
import torch

import torch_opaque
import archive_corpus as C
from opaque_fixtures import archops
from support.processes import run_python
from torch_opaque.archive import ArchiveLimits
from torch_opaque.archive.sym_expr import SymBudget, SymExprError, parse_sym_expr
from torch_opaque.archive.zipio import ZipReader
from torch_opaque.cli import main as cli_main

ALLOW = ["opaque_fixtures"]
MODEL = "/models/model.json"


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_cases(cases) -> list:
    """One report ({"error", "value", "warnings"}) per case, from one child."""
    proc = run_python(script="load_cases.py", args=[json.dumps(cases)], with_fixtures=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refused(report, *parts) -> None:
    assert report["error"] is not None, report
    kind, message = report["error"]
    assert kind == "ArchiveError", report
    for p in parts:
        assert str(p) in message, (p, message)


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    out = {"nested": d / "nested.pt2", "net": d / "net.pt2", "net_sc": d / "net_sc.pt2"}
    torch_opaque.save(archops.export_nested(), out["nested"], self_contained=True)
    torch_opaque.save(archops.export_net(), out["net"])
    torch_opaque.save(archops.export_net(), out["net_sc"], self_contained=True)
    return out


# ---- the stored call graph (Note [Stored call graph]) ----------------------------------------------


def _retarget(old_prefix: str, new_target: str, inputs=None):
    def edit(m):
        for node in C.graph_of(m)["nodes"]:
            if node["target"].startswith(old_prefix):
                node["target"] = new_target
                if inputs is not None:
                    node["inputs"] = inputs(node)
                return
        raise AssertionError(f"no {old_prefix} node")

    return C.edit_json(MODEL, edit)


def test_stored_programs_calling_themselves_or_each_other_are_refused(archives, tmp_path):
    """Outer's stored forward calls Cube's. (Before: RecursionError when run,
    SIGSEGV with a raised recursion limit.)"""
    src = archives["nested"]
    outer_fwd = C.stored_program_name(src, "ArchOuter", "fwd")
    cube_fwd = C.stored_program_name(src, "ArchCube", "fwd")
    self_call = tmp_path / "self_call.pt2"  # Outer's forward calls Outer
    C.edit_stored_program(src, self_call, "fwd", _retarget("torch.ops.opaque.ArchCube", "torch.ops.opaque.ArchOuter.Tensor"),
                          program=outer_fwd)  # fmt: skip
    mutual = tmp_path / "mutual.pt2"  # Outer -> Cube -> Outer
    C.edit_stored_program(
        src, mutual, "fwd",
        _retarget("torch.ops.aten.pow", "torch.ops.opaque.ArchOuter.Tensor",
                  lambda node: [{"name": "x", "arg": node["inputs"][0]["arg"], "kind": 1}]),
        program=cube_fwd,
    )  # fmt: skip
    x = archops.example_input()
    want = float((archops.NestedNet()(torch.ones(x.shape))).sum())
    cases = [
        {"path": str(self_call), "run": list(x.shape)},
        {"path": str(mutual), "run": list(x.shape)},
        {"path": str(src), "run": list(x.shape)},  # the honest archive, after the refused ones
        {"path": str(self_call), "run": list(x.shape)},  # refused again (not left half-loaded)
    ]
    r = run_cases(cases)
    refused(r[0], self_call, "cycle", "opaque::ArchOuter.Tensor -> opaque::ArchOuter.Tensor", "recurse")
    refused(r[1], mutual, "cycle", "opaque::ArchOuter.Tensor", "opaque::ArchCube.Tensor")
    assert r[2]["error"] is None and r[2]["value"] == pytest.approx(want, rel=1e-5)
    refused(r[3], "cycle")


CALL_REFUSED = r"""
import json, sys, torch, torch_opaque
try:
    torch_opaque.load(sys.argv[1])
except torch_opaque.ArchiveError:
    pass
packet = torch.ops.opaque.ArchOuter
(overload,) = [o for o in packet.overloads() if "_stored_" in o]
try:
    getattr(packet, overload)(torch.ones(5, 6))
    print(json.dumps(None))
except Exception as e:
    print(json.dumps([type(e).__name__, isinstance(e, torch_opaque.ArchiveError), overload, str(e)]))
"""


def test_a_refused_stored_overload_called_directly_says_why(archives, tmp_path):
    """The overloads a refused archive defined stay registered without
    programs. (Before: calling one raised a raw TypeError, 'NoneType' object
    is not callable.)"""
    self_call = tmp_path / "self_call.pt2"
    C.edit_stored_program(archives["nested"], self_call, "fwd",
                          _retarget("torch.ops.opaque.ArchCube", "torch.ops.opaque.ArchOuter.Tensor"),
                          program=C.stored_program_name(archives["nested"], "ArchOuter", "fwd"))  # fmt: skip
    proc = run_python(CALL_REFUSED, args=[self_call], with_fixtures=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kind, ours, overload, msg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "ArchiveError" and ours, msg
    assert "opaque::ArchOuter.Tensor has no stored programs to run" in msg, msg
    assert "the self-contained archive that defined it was refused when it loaded" in msg
    assert "cycle" in msg and "allow=[<defining module>]" in msg


def test_stored_call_depth_and_program_count_are_bounded(archives):
    """Outer -> Cube is 2 deep, and the archive stores 4 programs."""
    src = str(archives["nested"])
    r = run_cases([
        {"path": src, "options": {"limits": {"call_depth": 1}}, "run": [5, 6]},
        {"path": src, "options": {"limits": {"programs": 3}}, "run": [5, 6]},
        {"path": src, "options": {"limits": {"call_depth": 2, "programs": 4}}, "run": [5, 6]},
    ])  # fmt: skip
    refused(r[0], "2 deep", "opaque::ArchOuter.Tensor", "call_depth limit of 1", "ArchiveLimits(call_depth=")
    refused(r[1], "4 stored programs", "programs limit of 3", "ArchiveLimits(programs=")
    assert r[2]["error"] is None and r[2]["value"] is not None


# ---- the zip container (Note [Entries are streamed, never shared]) -----------------------------


def _rezip(src, dst, method_of) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for i in zin.infolist():
            zout.writestr(i.filename, zin.read(i), compress_type=method_of(i.filename))


@pytest.mark.parametrize("method, name", [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "LZMA")])
@pytest.mark.parametrize("entry", ["/extra/torch_opaque.json", MODEL, "/data/weights/weight_0"])
def test_entries_of_unbounded_methods_are_refused_by_name(archives, tmp_path, method, name, entry):
    """(Before: bzip2 and LZMA entries inflated past their declared size in one
    read, +1.8 GiB from 27 KiB.)"""
    p = tmp_path / "m.pt2"
    _rezip(archives["net"], p, lambda n: method if n.endswith(entry) else zipfile.ZIP_STORED)
    for src in (p, io.BytesIO(p.read_bytes())):
        with pytest.raises(torch_opaque.ArchiveError, match=f"compressed with {name}; torch_opaque reads only stored and deflate"):
            ZipReader(src, "m.pt2", ArchiveLimits())
    with pytest.raises(torch_opaque.ArchiveError, match=entry.rsplit("/", 1)[-1]):
        torch_opaque.load(p, allow=ALLOW)


def _with_records(src, dst, edit_records) -> None:
    """A hand-written copy of an archive whose (local, central) records
    `edit_records` may change: [name, data, crc, size, offset] lists."""
    entries = C.read_entries(src)
    out, recs = bytearray(), []
    for e in entries:
        recs.append([e.name.encode(), e.data, e.crc, e.size, len(out)])
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, e.crc, len(e.data), e.size, len(e.name), 0)
        out += e.name.encode() + e.data
    edit_records(recs)
    central = bytearray()
    for name, data, crc, size, offset in recs:
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, len(data), size,
                               len(name), 0, 0, 0, 0, 0, offset) + name  # fmt: skip
    cd = len(out)
    out += central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(recs), len(recs), len(central), cd, 0)
    dst.write_bytes(bytes(out))


def test_entries_sharing_their_bytes_are_refused(archives, tmp_path):
    """(Before: entries whose local headers overlap shared one deflate stream,
    +1.4 GiB from 690 KiB, each under the ratio cap.)"""
    root = C.root_of(archives["net"])

    def second_name_for_the_graph(recs):
        (graph,) = [r for r in recs if r[0].endswith(MODEL.encode())]
        recs.append([(root + "extra/again.json").encode(), *graph[1:]])

    def data_into_the_next_header(recs):
        recs[0][1] = recs[0][1] + b"\0" * 64  # the central record claims 64 more bytes

    for label, edit, what in (
        ("shared", second_name_for_the_graph, "overlaps entry"),
        ("longer", data_into_the_next_header, "overlaps entry"),
    ):
        p = tmp_path / f"{label}.pt2"
        _with_records(archives["net"], p, edit)
        with pytest.raises(torch_opaque.ArchiveError, match=f"{what} .*share their bytes are a zip bomb"):
            ZipReader(p, "x.pt2", ArchiveLimits())
        assert cli_main(["inspect", str(p)]) == 1


def test_deflated_archives_still_load(archives, tmp_path):
    """zip tools recompress with deflate: read as before, in bounded steps."""
    p = tmp_path / "deflated.pt2"
    _rezip(archives["net_sc"], p, lambda n: zipfile.ZIP_DEFLATED)
    plain = tmp_path / "plain_deflated.pt2"
    _rezip(archives["net"], plain, lambda n: zipfile.ZIP_DEFLATED)
    (a, b) = run_cases([{"path": str(p), "run": [5, 6]}, {"path": str(plain), "options": {"allow": ALLOW}, "run": [5, 6]}])
    assert a["error"] is None and b["error"] is None
    assert a["value"] == pytest.approx(b["value"], rel=1e-5)


# ---- CPU: symbolic expressions and pictures (Note [Symbolic work]) -----------------------------


def _symbols(n: int) -> list:
    return [f"Symbol('s{i}', integer=True, positive=True)" for i in range(n)]


@pytest.mark.parametrize("expr, why", [
    ("Max(" + ", ".join(_symbols(17)) + ")", "Max of 17 arguments (at most 16"),
    ("Min(" + ", ".join(_symbols(120)) + ")", "Min of 17 arguments (at most 16"),
    ("Add(" + ", ".join(_symbols(33)) + ")", "more than 32 distinct symbols"),
    ("Max(Add(" + ", ".join(_symbols(20)) + "), Add(" + ", ".join(_symbols(40)[20:]) + "))", "more than 32 distinct symbols"),
])  # fmt: skip
def test_costly_symbolic_expressions_are_refused_cheaply(archives, tmp_path, expr, why):
    """(Before: one Max of 120 symbols cost 28 CPU-s in sympy.)"""
    p = tmp_path / "sym.pt2"
    C.rewrite(archives["net"], p, C.edit_json(MODEL, lambda m: C.replace_expr(m, expr)))
    before = cpu_s()
    with pytest.raises(torch_opaque.ArchiveError, match="ArchiveLimits") as e:
        torch_opaque.load(p, allow=ALLOW)
    assert why in str(e.value), str(e.value)
    assert cpu_s() - before < 10  # a wide margin: refused before sympy compares anything


def test_symbolic_work_is_a_budget_per_program(archives, tmp_path):
    """Nine Max of 16 symbols compare 9 * 120 pairs, more than sym_work (1024):
    refused, in the archive and by the parser's budget alike."""
    big = "Max(" + ", ".join(_symbols(16)) + ")"
    budget = SymBudget()
    for _ in range(8):
        parse_sym_expr(big, budget)
    with pytest.raises(SymExprError, match="compare more than 1024 pairs"):
        parse_sym_expr(big, budget)
    parse_sym_expr(big, SymBudget())  # a fresh budget for the next program
    p = tmp_path / "work.pt2"
    C.rewrite(archives["net"], p, C.edit_json(MODEL, lambda m: C.replace_expr(m, big, count=9)))
    with pytest.raises(torch_opaque.ArchiveError, match=r"more than 1024 pairs .*ArchiveLimits\(sym_work="):
        torch_opaque.load(p, allow=ALLOW)
    # the caller may raise it for a file they trust
    torch_opaque.load(p, allow=ALLOW, limits=ArchiveLimits(sym_work=2000))


def _with_nodes(src, dst, n: int) -> None:
    def many_nodes(m):
        node = C.call_node("torch.ops.aten.neg.default", [("self", C.tensor("x"), 1)], ["n"])
        nodes = C.graph_of(m)["nodes"]
        for i in range(n - len(nodes)):
            nodes.append(dict(node, outputs=[C.tensor(f"n{i}")], name=f"n{i}"))

    C.rewrite(src, dst, C.edit_json(MODEL, many_nodes))


def test_pictures_of_huge_graphs_are_refused_with_the_flag_to_raise_it(archives, tmp_path, capsys):
    """(Before: inspect --graph of a 50,000-node program ran past 100 s.)"""
    p = tmp_path / "big.pt2"
    _with_nodes(archives["net"], p, 1500)
    svg = tmp_path / "g.svg"
    before = cpu_s()
    assert cli_main(["inspect", str(p), "--graph", str(svg)]) == 1
    err = capsys.readouterr().err
    assert "nodes, more than the 1000 a picture is drawn for" in err and "--max-nodes" in err, err
    assert not svg.exists() and cpu_s() - before < 30
    dot = tmp_path / "g.dot"  # no layout: written whole
    assert cli_main(["inspect", str(p), "--graph", str(dot)]) == 0
    assert dot.read_text().count("->") > 1000
    small = tmp_path / "small.pt2"
    _with_nodes(archives["net"], small, 60)
    assert cli_main(["inspect", str(small), "--graph", str(svg), "--max-nodes", "40"]) == 1
    assert "more than the 40" in capsys.readouterr().err
    assert cli_main(["inspect", str(small), "--graph", str(svg), "--max-nodes", "100"]) == 0
    assert svg.read_text().startswith("<?xml")


# ---- versions (Note [Archive versions]) --------------------------------------------------------


def _set_entry(suffix: str, value: bytes):
    return lambda n, b: value if n.endswith("/" + suffix) else b


@pytest.mark.parametrize("entry, value, what", [
    ("archive_version", b"99", "version is '99'"),
    ("archive_version", b"1", "version is '1'"),
    ("archive_format", b"zip", "format is 'zip'"),
    ("archive_format", b"pt3", "format is 'pt3'"),
])  # fmt: skip
def test_unknown_archive_versions_and_formats_are_refused(archives, tmp_path, entry, value, what):
    """(Before: archive_version 99 and an unknown archive_format loaded;
    torch.export.load refuses both.)"""
    for src in ("net", "nested"):
        p = tmp_path / f"{src}_{entry}.pt2"
        C.rewrite(archives[src], p, _set_entry(entry, value))
        with pytest.raises(torch_opaque.ArchiveError, match=what) as e:
            torch_opaque.load(p, allow=ALLOW)
        assert "torch_opaque reads the" in str(e.value) and ("'0'" in str(e.value) or "'pt2'" in str(e.value))
        assert cli_main(["inspect", str(p)]) == 1


def test_stored_programs_of_unknown_versions_are_refused(archives, tmp_path):
    for entry, value in (("archive_version", b"99"), ("archive_format", b"zip")):
        p = tmp_path / f"stored_{entry}.pt2"
        C.edit_stored_program(archives["nested"], p, "fwd", _set_entry(entry, value))
        (r,) = run_cases([{"path": str(p), "run": [5, 6]}])
        refused(r, f"is '{value.decode()}'", "stored fwd program")


@pytest.mark.parametrize("entry, what, supported", [
    ("archive_version", "version", "the versions '0'"),
    ("archive_format", "format", "the formats 'pt2'"),
])  # fmt: skip
def test_archives_without_a_version_or_format_are_refused(archives, tmp_path, entry, what, supported):
    """(Before: an archive without these entries loaded, read as pt2 version 0.)"""
    drop = lambda n, b: None if n.endswith("/" + entry) else b  # noqa: E731
    p = tmp_path / f"no_{entry}.pt2"
    C.rewrite(archives["net"], p, drop)
    with pytest.raises(torch_opaque.ArchiveError) as e:
        torch_opaque.load(p, allow=ALLOW)
    msg = str(e.value)
    assert f"has no pt2 archive {what} (no entry '{C.root_of(p)}{entry}')" in msg, msg
    assert f"torch_opaque reads {supported}" in msg and "save the program again with torch_opaque.save" in msg
    assert cli_main(["inspect", str(p)]) == 1
    inner = tmp_path / f"stored_no_{entry}.pt2"
    C.edit_stored_program(archives["nested"], inner, "fwd", drop)
    (r,) = run_cases([{"path": str(inner), "run": [5, 6]}])
    refused(r, f"has no pt2 archive {what}", "stored fwd program", supported)


def test_the_fixture_archives_all_name_their_version_and_format():
    """Every archive an earlier torch_opaque wrote has both entries (so
    refusing a missing one refuses no archive torch_opaque wrote)."""
    import zipfile

    from support.processes import FIXTURES_DIR

    for path in sorted(FIXTURES_DIR.glob("*.pt2")):
        with zipfile.ZipFile(path) as z:
            names = {n.split("/", 1)[1] for n in z.namelist()}
        assert {"archive_format", "archive_version"} <= names, path


def test_newer_manifest_versions_name_the_versions_read(archives, tmp_path):
    m = C.manifest_of(archives["net"])
    m["version"] = 3
    p = tmp_path / "v3.pt2"
    C.with_manifest(archives["net"], p, m)
    with pytest.raises(torch_opaque.ArchiveError, match="version 3 is not one this torch_opaque reads .it reads versions 1, 2."):
        torch_opaque.load(p, allow=ALLOW)


# ---- threads (Note [One deserializer at a time]) -----------------------------------------------

THREADS = r"""
import json, sys, threading
import torch, torch_opaque
plain, sc, nested = sys.argv[1:4]
x = torch.ones(5, 6)
results, errors = {}, []
def work(i):
    try:
        path, allow = [(plain, ["opaque_fixtures"]), (sc, []), (nested, [])][i % 3]
        ep = torch_opaque.load(path, allow=allow)
        results[i] = (path, float(ep.module()(x).sum()))
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
threads = [threading.Thread(target=work, args=(i,)) for i in range(int(sys.argv[4]))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"results": list(results.values()), "errors": errors}))
"""


def test_concurrent_loads_all_succeed_with_equal_results(archives):
    """(Before: of 8 threads loading at once, 1 loaded and 7 got ArchiveError.)"""
    for n in (8, 12):
        proc = run_python(THREADS, args=[archives["net"], archives["net_sc"], archives["nested"], n], with_fixtures=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["errors"] == [] and len(r["results"]) == n
        by_path: dict = {}
        for path, value in r["results"]:
            by_path.setdefault(path, set()).add(value)
        assert all(len(v) == 1 for v in by_path.values()), by_path
        (plain,), (sc,) = by_path[str(archives["net"])], by_path[str(archives["net_sc"])]
        assert plain == pytest.approx(sc, rel=1e-5)  # the stored programs compute the Functions'
