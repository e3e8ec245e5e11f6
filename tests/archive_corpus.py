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


def edit_stored_program(src, dst, which: str, inner_edit: Callable, inner_add=()) -> None:
    """Rewrites the first stored `which` ('fwd' / 'bwd') program of a
    self-contained archive (a whole pt2 archive, base64, in an extra file)."""
    import tempfile

    done = []

    def edit(name, data):
        if name.endswith("." + which) and "/extra/torch_opaque.program." in name and not done:
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
