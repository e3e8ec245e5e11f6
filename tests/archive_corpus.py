"""Crafted .pt2 archives, as an attacker would write them (used by
tests/archive/test_archive_corpus.py).

Each case is a file plus what ``torch_opaque.load`` and ``inspect`` must do
with it. Every pickle planted here, when unpickled, creates the marker file
(``payload_bytes``); :func:`check_payload_is_live` proves it does.

Zip bombs are written by hand (:func:`write_zip`): the deflate stream of 1 GiB
of spaces is made of one full-flushed block of 1 MiB repeated 1024 times
(a full flush resets the compressor, so the block is the same every time),
which takes a second instead of compressing a gigabyte per case.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import pickle
import struct
import zipfile
import zlib
from typing import Callable, Optional

import torch

GiB = 1 << 30
_BLOCK = b" " * (1 << 20)


class Payload:
    """Unpickling it opens (creates) the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload_bytes(marker: str, torch_format: bool = True) -> bytes:
    if not torch_format:
        return pickle.dumps(Payload(marker), protocol=2)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


def check_payload_is_live(marker) -> bool:
    """The payload does run when unpickled without restriction (so a test that
    sees no marker shows the payload was not run, not that it is inert)."""
    torch.load(io.BytesIO(payload_bytes(str(marker))), weights_only=False)
    return marker.exists()


# ---- zip files written by hand -----------------------------------------------------------


@dataclasses.dataclass
class Entry:
    name: str
    data: bytes  # as stored (compressed when method == 8)
    crc: int
    size: int  # inflated size declared in the headers
    method: int = 0  # 0 stored, 8 deflated


def stored(name: str, data: bytes) -> Entry:
    return Entry(name, data, zlib.crc32(data), len(data))


_BOMB: dict = {}


def bomb(name: str, size: int = GiB, declared: Optional[int] = None) -> Entry:
    """An entry of `size` spaces, deflated (about 1 MiB per GiB); `declared`
    makes its headers lie about the inflated size."""
    if size not in _BOMB:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        block = c.compress(_BLOCK) + c.flush(zlib.Z_FULL_FLUSH)
        n = size // len(_BLOCK)
        crc = 0
        for _ in range(n):
            crc = zlib.crc32(_BLOCK, crc)
        _BOMB[size] = (block * n + c.flush(), crc)
    data, crc = _BOMB[size]
    return Entry(name, data, crc, size if declared is None else declared, method=8)


def write_zip(path, entries: list) -> None:
    """Writes `entries` as a zip to a path or a binary file object."""
    out = bytearray()
    central = bytearray()
    for e in entries:
        name = e.name.encode()
        offset = len(out)
        out += struct.pack(
            "<4s5H3L2H", b"PK\x03\x04", 20, 0, e.method, 0, 0x21, e.crc, len(e.data), e.size, len(name), 0
        )
        out += name + e.data
        central += struct.pack(
            "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, e.method, 0, 0x21, e.crc, len(e.data), e.size,
            len(name), 0, 0, 0, 0, 0, offset,
        )  # fmt: skip
        central += name
    cd_offset = len(out)
    out += central
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), cd_offset, 0)
    if hasattr(path, "write"):
        path.write(out)
        return
    with open(path, "wb") as f:
        f.write(out)


def read_entries(path) -> list:
    with zipfile.ZipFile(path) as zf:
        return [stored(i.filename, zf.read(i)) for i in zf.infolist()]


def rewrite(src, dst, edit: Callable[[str, bytes], Optional[bytes]], add=()) -> None:
    """Copies an archive, passing each entry through `edit` (None drops it)."""
    entries = []
    for e in read_entries(src):
        data = edit(e.name, e.data)
        if data is not None:
            entries.append(stored(e.name, data))
    write_zip(dst, entries + list(add))


def root_of(path) -> str:
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()[0].split("/")[0] + "/"


def manifest_of(path) -> dict:
    with zipfile.ZipFile(path) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        return json.loads(zf.read(name))


def with_manifest(src, dst, manifest: dict) -> None:
    text = json.dumps(manifest).encode()
    rewrite(src, dst, lambda n, d: text if n.endswith("/extra/torch_opaque.json") else d)


def edit_json(name_suffix: str, fn: Callable[[dict], None]) -> Callable:
    def edit(name, data):
        if name.endswith(name_suffix):
            d = json.loads(data)
            fn(d)
            return json.dumps(d).encode()
        return data

    return edit


def edit_stored_program(src, dst, which: str, inner_edit: Callable, inner_add=(), program: Optional[str] = None) -> None:
    """Rewrites the first stored `which` ('fwd' / 'bwd') program of a
    self-contained archive (a whole pt2 archive, base64, in an extra file), or
    the one named `program` (:func:`stored_program_name`)."""
    import tempfile

    done = []

    def wanted(name):
        if program is not None:
            return name.endswith("/extra/" + program)
        return name.endswith("." + which) and "/extra/torch_opaque.program." in name

    def edit(name, data):
        if wanted(name) and not done:
            done.append(name)
            with tempfile.TemporaryDirectory() as d:
                inner = f"{d}/inner.pt2"
                with open(inner, "wb") as f:
                    f.write(base64.b64decode(data))
                rewrite(inner, f"{d}/out.pt2", inner_edit, [a(root_of(inner)) for a in inner_add])
                with open(f"{d}/out.pt2", "rb") as f:
                    return base64.b64encode(f.read())
        return data

    rewrite(src, dst, edit)
    assert done, "no stored program"


def set_path(d, path: str, value) -> None:
    """Sets d[...] by a manifest field path like 'ops[0].overloads[0].n_out'."""
    keys = []
    for part in path.split("."):
        name, _, rest = part.partition("[")
        if name:
            keys.append(name)
        for idx in rest.rstrip("]").split("][") if rest else []:
            keys.append(int(idx))
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


def first_node_target(model: dict) -> dict:
    """The first call node of a serialized graph (to point its target elsewhere)."""
    return next(n for n in model["graph_module"]["graph"]["nodes"] if n["target"].startswith("torch.ops.aten"))


# ---- more hand-written zips ----------------------------------------------------------------


def write_many_records(path, n: int, zip64: bool = True) -> None:
    """A zip of one small stored entry and `n` central-directory records that
    all point at it (distinct names), the way a directory-only bomb is built.
    `zip64`: the record count is told by a zip64 end record (as zip tools do
    past 65535 entries); otherwise the classic end record says 65535 while the
    directory, walked by its byte size, holds all of them."""
    data = b"x"
    crc = zlib.crc32(data)
    first = b"net/extra/e0"
    out = bytearray(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, 1, 1, len(first), 0))
    out += first + data
    records = []
    for i in range(n):
        name = f"net/extra/e{i}".encode()
        records.append(
            struct.pack(
                "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, 1, 1,
                len(name), 0, 0, 0, 0, 0, 0,
            ) + name
        )  # fmt: skip
    central = b"".join(records)
    cd_offset = len(out)
    out += central
    if zip64:
        eocd64 = len(out)
        out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
        out += struct.pack("<4sLQL", b"PK\x06\x07", 0, eocd64, 1)
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, len(central), cd_offset, 0)
    with open(path, "wb") as f:
        f.write(out)


# ---- editing serialized graphs -------------------------------------------------------------


def graph_of(model: dict) -> dict:
    return model["graph_module"]["graph"]


def json_objects(obj):
    """Every JSON object (dict) in `obj`, nested ones included, parents first."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            yield o
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, list):
            stack.extend(reversed(o))


def rename_value(model: dict, old: str, new: str) -> None:
    """Renames a tensor value everywhere it is named: the graph's inputs and
    outputs, node arguments and outputs, the signature, ``tensor_values``."""
    for o in json_objects(model):
        if set(o) == {"name"} and o["name"] == old:  # a TensorArgument
            o["name"] = new
    tv = graph_of(model)["tensor_values"]
    tv[new] = tv.pop(old)


def add_placeholder(model: dict, name: str, like: str) -> None:
    """One more user input (unused by any node), with the metadata of `like`."""
    g = graph_of(model)
    g["inputs"].append({"as_tensor": {"name": name}})
    g["tensor_values"][name] = json.loads(json.dumps(g["tensor_values"][like]))
    model["graph_module"]["signature"]["input_specs"].append({"user_input": {"arg": {"as_tensor": {"name": name}}}})


def call_node(target: str, inputs: list, outputs: list) -> dict:
    """A serialized call node (named after its first output); `inputs`: (name,
    argument, kind) with kind 1 positional, 2 keyword; `outputs`: value names
    (tensors)."""
    return {
        "target": target,
        "inputs": [{"name": n, "arg": a, "kind": k} for n, a, k in inputs],
        "outputs": [{"as_tensor": {"name": o}} for o in outputs],
        "metadata": {},
        "is_hop_single_tensor_return": None,
        "name": outputs[0] if outputs else "",
    }


def tensor(name: str) -> dict:
    return {"as_tensor": {"name": name}}


def replace_expr(model: dict, new: str, count: int = 1) -> None:
    """Replaces the first `count` symbolic size expressions (``expr_str``) of a
    graph by `new`."""
    done = 0
    for o in json_objects(model):
        if isinstance(o.get("expr_str"), str) and done < count:
            o["expr_str"] = new
            done += 1
    assert done, "no symbolic expression in the graph"


def edit_text(name_suffix: str, pattern: str, replacement: str) -> Callable:
    """An entry edit replacing the first match of a regex in a JSON entry's text
    (for values json.dumps cannot write, such as a 5000-digit integer)."""
    import re

    def edit(name, data):
        if name.endswith(name_suffix):
            text, n = re.subn(pattern, replacement, data.decode(), count=1)
            assert n == 1, (name, pattern)
            return text.encode()
        return data

    return edit


def stored_program_name(path, op_name: str, which: str) -> str:
    """The extra file name ('torch_opaque.program.N.fwd') of the first stored
    `which` program of an op of a self-contained archive."""
    (op,) = [o for o in manifest_of(path)["ops"] if o["name"] == op_name]
    return op["overloads"][0]["variants"][0][which]


def sparse_parameter_bytes(size=(8, 6), index: int = 1 << 40) -> bytes:
    """torch.save bytes of a sparse COO Parameter whose index lies far outside
    its size (torch.load(weights_only=True) does not check sparse invariants)."""
    i = torch.tensor([[0, index], [0, index]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), size, check_invariants=False)
    buf = io.BytesIO()
    torch.save(torch.nn.Parameter(t), buf)
    return buf.getvalue()


# ---- a program with a higher-order operator --------------------------------------------------


class GradNet(torch.nn.Module):
    """``torch.no_grad()`` inside forward: export writes a
    ``wrap_with_set_grad_enabled`` call whose body is a nested graph (a get_attr
    of a submodule in the loaded program)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = x + 1
        with torch.no_grad():
            z = self.l(y).sin()
        return z + x


def export_hop():
    return torch.export.export(GradNet(), (torch.randn(2, 3),))


def hop_node(model: dict) -> dict:
    return next(n for n in graph_of(model)["nodes"] if n["target"].startswith("torch.ops.higher_order."))


# ---- running cases in fresh interpreters -------------------------------------------------------

ANY = "any"  # an expectation: any outcome but a crash or an error torch_opaque did not raise
# CPU seconds (of the child, not wall time: the machine may be loaded) one
# step of one case may take; and the CPU time after which the kernel stops a
# case that hangs (RLIMIT_CPU in the child), failing it.
STEP_CPU_S = 20
CASE_CPU_KILL_S = 40


def _died(rc) -> str:
    import signal

    if rc == "timeout":
        return "did not finish in 600 s of wall time"
    if isinstance(rc, int) and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = " (the CPU limit of a case: it hangs)" if -rc == signal.SIGXCPU else ""
        return f"was killed by {name}{why}"
    return f"exited with status {rc}"


def run_cases(
    cases, tmp_path, marker, case_cpu_kill_s: float = CASE_CPU_KILL_S, as_headroom_mib: int = 0,
    script: str = "load_and_inspect_cases.py", with_fixtures: bool = True,
) -> dict:  # fmt: skip
    """Loads, inspects and runs each case (name, path, load options, ...) in a
    fresh interpreter (`script` in tests/support/scripts, working directory
    `tmp_path`; `with_fixtures`: tests/ on its path): name -> its result. A case
    the interpreter died in gets {"died": how}, and the cases after it run in a
    fresh interpreter. `as_headroom_mib`: the address space the cases may add
    to the child's once it imported torch (RLIMIT_AS), 0 for no limit."""
    import subprocess

    from support.processes import run_python

    results: dict = {}
    todo = list(cases)
    while todo:
        spec = tmp_path / f"cases_{len(list(tmp_path.iterdir()))}.json"
        spec.write_text(json.dumps([{"name": c[0], "path": str(c[1]), "options": c[2]} for c in todo]))
        try:
            proc = run_python(
                script=script, args=[marker, spec, case_cpu_kill_s, as_headroom_mib],
                cwd=tmp_path, with_fixtures=with_fixtures, timeout=600,
            )  # fmt: skip
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = e.stdout or "", e.stderr or "", "timeout"
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
        started = None
        for line in out.splitlines():
            if line.startswith("START "):
                started = json.loads(line[len("START ") :])
            elif line.startswith("CASE "):
                d = json.loads(line[len("CASE ") :])
                results[d["name"]] = d["result"]
                started = None
        left = [c for c in todo if c[0] not in results]
        if not left and rc == 0:
            break
        assert started is not None, f"the child {_died(rc)} outside a case:\n{out[-2000:]}\n{err[-4000:]}"
        results[started] = {"died": f"{_died(rc)}; its stderr ends: {err[-600:]!r}"}
        todo = [c for c in left if c[0] != started]
    return results


def check_results(cases, results, peak_rise_mib: float) -> list:
    """The failures: each case's steps against its expectations (name, path,
    options, expected load, expected inspect), the marker, the CPU time of each
    step, how far its peak memory rose (Note [Memory measured from the imported
    interpreter] in support/scripts/load_and_inspect_cases.py), whether the
    program run changed its inputs.

    An expectation is "ok", ANY, or (error type, text or tuple of texts the
    message contains); an error must be one torch_opaque raises (a
    TorchOpaqueError) and its message start with "torch_opaque"."""
    failures = []
    for name, _path, _opts, want_load, want_inspect in cases:
        r = results[name]
        if "died" in r:
            failures.append(f"{name}: the interpreter {r['died']}")
            continue
        for what, want in (("load", want_load), ("inspect", want_inspect), ("run", None)):
            if what not in r:
                continue  # no run: the load failed
            got_type, msg, ours = r[what]
            if r[what + "_marker"]:
                failures.append(f"{name}: {what} ran the payload")
            if r[what + "_cpu_s"] > STEP_CPU_S:
                failures.append(f"{name}: {what} took {r[what + '_cpu_s']:.1f} s of CPU")
            if r[what + "_peak_rise_mib"] > peak_rise_mib:
                failures.append(f"{name}: {what} raised the peak resident size by {r[what + '_peak_rise_mib']:.0f} MiB")
            if what == "run":
                if r.get("run_mutated"):
                    failures.append(f"{name}: running the loaded program changed its inputs")
                continue
            if want == ANY:
                if got_type != "ok" and not ours:
                    failures.append(f"{name}: {what} failed with an error torch_opaque did not raise: {got_type}: {msg}")
                continue
            if want == "ok":
                if got_type != "ok":
                    failures.append(f"{name}: {what} failed: {got_type}: {msg}")
                continue
            want_type, frags = want
            frags = (frags,) if isinstance(frags, str) else frags
            if got_type != want_type or not all(f in msg for f in frags) or not ours:
                failures.append(f"{name}: {what}: want {want_type} with {frags!r}, got {got_type}: {msg}")
            elif not msg.startswith("torch_opaque"):
                failures.append(f"{name}: {what}: message lacks the prefix: {msg}")
    return failures
