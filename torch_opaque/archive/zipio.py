"""Reading a .pt2 zip archive with bounded memory: sizes are checked from the zip
headers before anything is inflated, and every read stops at the declared size.

Example::

    >>> import io, zipfile
    >>> from torch_opaque.archive.zipio import ArchiveLimits, ZipReader
    >>> buf = io.BytesIO()
    >>> with zipfile.ZipFile(buf, "w") as zf:
    ...     zf.writestr("m/extra/note.txt", "hi")
    >>> with ZipReader(buf, "<buf>", ArchiveLimits()) as z:
    ...     z.read("m/extra/note.txt", "other")
    b'hi'

Note [Size limits]
A zip entry says how large it inflates to (central directory ``file_size``)
and how many bytes it occupies (``compress_size``). Before any entry is read,
every entry is checked against the limit of its kind (manifest, model graph,
stored program, tensor data, other) and against a compression ratio limit
(tensor data written by torch is stored, not compressed, so a large entry that
inflates hundreds of times is a bomb). Reads then go through zipfile's stream
in chunks and stop at the declared size, so an entry whose header lies cannot
inflate further; zipfile checks the CRC at the end of each entry. Each kind's
limit can be raised with ``torch_opaque.load(..., limits=ArchiveLimits(...))``.

Note [Entries are streamed, never shared]
Only the two methods pt2 archives use are read: stored (torch writes every
entry so) and deflate (zip tools recompress with it). zipfile inflates deflate
in bounded steps (a ``max_length`` per read), but hands a bzip2 or LZMA entry's
whole compressed input to the decompressor in one call, so such an entry
inflates past its declared size before a read could stop: those methods (and
any other) are refused by name from the central directory, before anything
is read. Each entry must also own its bytes: the span of its local header
(read from the file: 30 bytes, its name, its extra field) and its compressed
data may not overlap the next entry's, nor the central directory. Entries
sharing one deflate stream would each pass the ratio cap while the file as a
whole inflates without bound.

Note [Central directory before zipfile]
``zipfile.ZipFile`` builds a ZipInfo for every record of the central directory
as soon as it opens a file, walking the directory by its declared byte size,
not by its entry count: 1M records (a 55 MiB file) cost over 100 MiB, and CPU
in proportion, before the number of entries could be checked. So ZipReader first reads
the end-of-central-directory record (and the zip64 one) from the file's tail,
the same record zipfile will use, and refuses an entry count over
``ArchiveLimits.entries``, a directory size that cannot hold that many records
(46 to 46 + 3 * 65535 bytes each) or that exceeds ``ArchiveLimits.metadata``;
then it walks the record headers itself (struct only, no objects) and refuses a
directory holding more records than its end record declares, or (where a
classic end record says 65535, which writers without zip64 saturate) more than
``entries``. Only then does zipfile parse it, at most ``entries`` records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zipfile
import zlib
from typing import Optional

from ..errors import ArchiveError

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ArchiveLimits:
    """The largest sizes (inflated, in bytes) ``load`` and ``inspect`` accept
    (Note [Size limits]). Raise one for an archive you trust that is larger::

        torch_opaque.load(path, limits=ArchiveLimits(model=2 * GiB))
    """

    manifest: int = 16 * MiB  # extra/torch_opaque.json
    model: int = 256 * MiB  # models/<name>.json (the serialized graph), and its configs
    program: int = 64 * MiB  # each stored program of a self-contained archive
    tensors: int = 64 * GiB  # all weights and constants together
    other: int = 16 * MiB  # any other entry that is read
    metadata: int = 1 * GiB  # everything but tensors, all entries together
    ratio: int = 200  # inflated / compressed, for entries above 1 MiB
    entries: int = 100_000  # number of entries in the archive
    nodes: int = 50_000  # graph nodes of one program, nested graphs included (~0.4 ms CPU each)
    programs: int = 1000  # stored programs of a self-contained archive (~35 ms CPU each to read)
    call_depth: int = 32  # stored programs calling stored programs (Note [Stored call graph])
    sym_args: int = 16  # arguments of one symbolic-size call (Max, Add, ...; Note [Symbolic work])
    sym_symbols: int = 32  # distinct size symbols in one expression
    sym_work: int = 1024  # argument pairs sympy compares, summed over a program's expressions
    picture_nodes: int = 1000  # nodes `inspect --graph` draws (layout time grows with the square)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"torch_opaque: ArchiveLimits.{f.name} must be a positive int, got {v!r}")


_ZIP_ERRORS = (
    OSError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    ValueError,
    zlib.error,
    NotImplementedError,
    RuntimeError,  # encrypted entries
)

_CHUNK = 1 * MiB
_KINDS = ("manifest", "model", "program", "tensors", "other")

# The zip records read before zipfile parses anything (Note [Central directory
# before zipfile]); the same layouts and search as CPython's zipfile.
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes + comment
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, just before the EOCD
_EOCD64_LOCATOR_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # 56 bytes, just before the locator
_EOCD64_SIG = b"PK\x06\x06"
_CD_RECORD = struct.Struct("<4s4B4HL2L5H2L")  # a central-directory record: 46 bytes + name/extra/comment
_CD_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4s5H3L2H")  # a local file header: 30 bytes + name/extra
_LOCAL_SIG = b"PK\x03\x04"
# Note [Entries are streamed, never shared]: the methods pt2 archives use
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_METHOD_NAMES = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}
_MAX_COMMENT = 1 << 16  # zipfile searches the last 64 KiB + 22 bytes for the EOCD
_MAX_CD_RECORD = _CD_RECORD.size + 3 * 0xFFFF


# Integers of JSON entries: torch writes int64 values (19 digits and a sign) and
# unsigned 64-bit ones at most; beyond that json.loads would spend quadratic time
# (and Python refuses more than 4300 digits with a ValueError naming no entry).
MAX_JSON_INT_DIGITS = 20


def _json_int(s: str) -> int:
    digits = len(s) - (s[:1] == "-")
    if digits > MAX_JSON_INT_DIGITS:
        raise ValueError(
            f"it holds an integer of {digits} digits ({s[:12]}...); torch writes 64-bit "
            f"integers, at most {MAX_JSON_INT_DIGITS} digits"
        )
    return int(s)


def _json_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"it holds the number {s[:24]!r}, which overflows a float")
    return v


def _json_constant(s: str):
    raise ValueError(
        f"it holds a bare {s}, which is not JSON (torch writes non-finite floats as the "
        f"strings \"Infinity\", \"-Infinity\", \"NaN\")"
    )


def loads_json(text):
    """``json.loads`` for the JSON entries of an archive: integers of at most
    :data:`MAX_JSON_INT_DIGITS` digits, finite floats, no bare NaN/Infinity
    (torch and torch_opaque write neither). Every failure is a ValueError
    (json.JSONDecodeError among them) or a RecursionError (nesting too deep);
    callers turn it into an ArchiveError naming the entry."""
    return json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)


def describe(path) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    return f"<{type(path).__name__}>"


def bad_name(name: str) -> Optional[str]:
    """Why an entry name is unsafe (absolute, '..', backslash, NUL...), or None."""
    if not name:
        return "it is empty"
    if "\x00" in name:
        return "it contains a NUL character"
    if "\\" in name:
        return "it contains a backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "it is an absolute path"
    if any(part in ("..", ".") for part in name.split("/")):
        return "it has a '.' or '..' component (path traversal)"
    return None


class ZipReader:
    """A zip archive read entry by entry within :class:`ArchiveLimits`; every
    problem is an ArchiveError naming the file (and the entry). A missing file
    stays a plain FileNotFoundError."""

    def __init__(self, path, description: str, limits: ArchiveLimits):
        self.description = description
        self.limits = limits
        self.tensor_bytes = 0
        self.metadata_bytes = 0
        if isinstance(path, (str, os.PathLike)):
            self.file = open(path, "rb")
            self.pos = None
        else:
            self.file = path
            self.pos = path.tell() if hasattr(path, "tell") else None
        try:
            self._check_central_directory()
            self.zf = zipfile.ZipFile(self.file)
            infos = self.zf.infolist()
        except ArchiveError:  # a RuntimeError: before _ZIP_ERRORS
            self.close()
            raise
        except _ZIP_ERRORS as e:
            self.close()
            raise self.unreadable(e) from e
        try:
            self._check_directory(infos)
        except ArchiveError:
            self.close()
            raise
        self.infos = {i.filename: i for i in infos}
        self.names = [i.filename for i in infos]

    def unreadable(self, e: BaseException) -> ArchiveError:
        return ArchiveError(
            f"torch_opaque: cannot read {self.description}: {type(e).__name__}: {e}. The file "
            f"is truncated or corrupted, or is not a .pt2 archive written by "
            f"torch.export.save / torch_opaque.save."
        )

    def _too_many_entries(self, count: int, at_least: bool = False) -> ArchiveError:
        return ArchiveError(
            f"torch_opaque: {self.description} has {'at least ' if at_least else ''}{count} "
            f"entries, more than the "
            f"limit of {self.limits.entries} (raise it with "
            f"limits=ArchiveLimits(entries=...) if you trust the file)."
        )

    def _end_record(self) -> Optional[tuple]:
        """(entry count, central directory size, its offset in the file, whether
        the count came from a zip64 record) from the end-of-central-directory
        record zipfile would use (and its zip64 record), or None where there is
        none (zipfile then refuses the file)."""
        f = self.file
        f.seek(0, 2)
        filesize = f.tell()
        tail_start = max(filesize - _MAX_COMMENT - _EOCD.size, 0)
        f.seek(tail_start)
        tail = f.read(filesize - tail_start)
        if len(tail) >= _EOCD.size and tail[-_EOCD.size : -_EOCD.size + 4] == _EOCD_SIG and tail[-2:] == b"\0\0":
            start = len(tail) - _EOCD.size  # no comment: zipfile's first try
        else:
            start = tail.rfind(_EOCD_SIG)
            if start < 0 or len(tail) - start < _EOCD.size:
                return None
        _, _, _, n_disk, n_total, cd_size, _, _ = _EOCD.unpack_from(tail, start)
        count = max(n_disk, n_total)
        location = tail_start + start  # of the EOCD in the file
        cd_end = location
        zip64 = False
        if location >= _EOCD64_LOCATOR.size:
            f.seek(location - _EOCD64_LOCATOR.size)
            loc = f.read(_EOCD64_LOCATOR.size)
            if len(loc) == _EOCD64_LOCATOR.size and loc[:4] == _EOCD64_LOCATOR_SIG:
                _, z64_disk, _, disks = _EOCD64_LOCATOR.unpack(loc)
                if z64_disk != 0 or disks > 1:
                    raise ArchiveError(
                        f"torch_opaque: cannot read {self.description}: it spans several "
                        f"disks (a multi-part zip), which pt2 archives never do."
                    )
                z64_at = location - _EOCD64_LOCATOR.size - _EOCD64.size
                if z64_at >= 0:
                    f.seek(z64_at)
                    z64 = f.read(_EOCD64.size)
                    if len(z64) == _EOCD64.size and z64[:4] == _EOCD64_SIG:
                        (_, _, _, _, _, _, n_disk, n_total, cd_size, _) = _EOCD64.unpack(z64)
                        count = max(n_disk, n_total)
                        cd_end = z64_at
                        zip64 = True
        return count, cd_size, cd_end - cd_size, zip64

    def _check_central_directory(self) -> None:
        """Note [Central directory before zipfile]."""
        end = self._end_record()
        if end is None:
            return  # not a zip file: zipfile says so
        count, cd_size, cd_start, zip64 = end
        if count > self.limits.entries:
            raise self._too_many_entries(count)
        if not count * _CD_RECORD.size <= cd_size <= count * _MAX_CD_RECORD:
            raise ArchiveError(
                f"torch_opaque: {self.description} has a zip central directory of {cd_size} "
                f"bytes for {count} entries, which cannot be (each record takes "
                f"{_CD_RECORD.size} to {_MAX_CD_RECORD} bytes); the archive was crafted or "
                f"corrupted."
            )
        if cd_size > self.limits.metadata:
            raise ArchiveError(
                f"torch_opaque: {self.description} has a zip central directory of {cd_size} "
                f"bytes, more than the metadata limit of {self.limits.metadata} bytes. Raise "
                f"it with limits=ArchiveLimits(metadata=...) if you trust the file."
            )
        if cd_start < 0:
            return  # zipfile refuses it ("Bad offset for central directory")
        self.file.seek(cd_start)
        data = self.file.read(cd_size)
        # a classic end record that says 65535 may stand for more (writers without
        # zip64 saturate it): the records are then counted up to the limit only
        saturated = count == 0xFFFF and not zip64
        pos = records = 0
        while pos < cd_size:
            if records >= self.limits.entries:
                raise self._too_many_entries(records + 1, at_least=True)
            if records >= count and not saturated:
                raise ArchiveError(
                    f"torch_opaque: the zip central directory of {self.description} holds more "
                    f"records than the {count} its end record declares; the archive was "
                    f"crafted or corrupted."
                )
            if len(data) - pos < _CD_RECORD.size or data[pos : pos + 4] != _CD_SIG:
                return  # truncated or not a record: zipfile refuses it
            rec = _CD_RECORD.unpack_from(data, pos)
            pos += _CD_RECORD.size + rec[12] + rec[13] + rec[14]
            records += 1

    def _check_directory(self, infos) -> None:
        if len(infos) > self.limits.entries:
            raise self._too_many_entries(len(infos))
        seen = set()
        for i in infos:
            why = bad_name(i.filename)
            if why is not None:
                raise ArchiveError(
                    f"torch_opaque: {self.description} has an entry named {i.filename!r}: {why}. "
                    f"The archive was crafted or corrupted; it is not loaded."
                )
            if i.filename in seen:
                raise ArchiveError(
                    f"torch_opaque: {self.description} has two entries named {i.filename!r}; "
                    f"the archive was crafted or corrupted."
                )
            seen.add(i.filename)
            if i.flag_bits & 0x1:
                raise ArchiveError(
                    f"torch_opaque: entry '{i.filename}' in {self.description} is encrypted; "
                    f"pt2 archives are not."
                )
            if i.compress_type not in _METHODS:
                method = _METHOD_NAMES.get(i.compress_type, f"method {i.compress_type}")
                raise ArchiveError(
                    f"torch_opaque: entry '{i.filename}' in {self.description} is compressed with "
                    f"{method}; torch_opaque reads only stored and deflate entries (what "
                    f"torch.export.save and zip tools write), because other methods inflate "
                    f"without a bound. Re-zip the archive with deflate (or save it again)."
                )
        self._check_spans(infos)

    def _check_spans(self, infos) -> None:
        """Note [Entries are streamed, never shared]: no two entries' local
        headers and data overlap."""
        end_of_data = self.zf.start_dir if hasattr(self.zf, "start_dir") else None
        spans = []
        for i in infos:
            raw = b""
            if i.header_offset >= 0:
                try:
                    self.file.seek(i.header_offset)
                    raw = self.file.read(_LOCAL.size)
                except (OSError, ValueError, OverflowError):
                    raw = b""
            if len(raw) != _LOCAL.size or raw[:4] != _LOCAL_SIG:
                raise ArchiveError(
                    f"torch_opaque: entry '{i.filename}' in {self.description} has no local "
                    f"header at offset {i.header_offset}; the archive is truncated or corrupted."
                )
            name_len, extra_len = _LOCAL.unpack(raw)[-2:]
            spans.append((i.header_offset, i.header_offset + _LOCAL.size + name_len + extra_len + i.compress_size, i.filename))
        spans.sort()
        for (start, end, name), nxt in zip(spans, spans[1:] + [None]):
            limit, other = (nxt[0], f"entry '{nxt[2]}'") if nxt is not None else (end_of_data, "the central directory")
            if limit is not None and end > limit:
                raise ArchiveError(
                    f"torch_opaque: entry '{name}' in {self.description} overlaps {other} "
                    f"(its header and data span bytes {start} to {end}, the other starts at "
                    f"{limit}): entries that share their bytes are a zip bomb; the archive was "
                    f"crafted and is not loaded."
                )

    def check(self, name: str, kind: str) -> int:
        """The declared inflated size of an entry, after checking it against the
        limits of its kind (without reading it)."""
        info = self.infos.get(name)
        if info is None:
            raise ArchiveError(
                f"torch_opaque: {self.description} lacks the entry '{name}'; the archive is "
                f"truncated or corrupted."
            )
        if kind not in _KINDS:
            raise ValueError(f"torch_opaque: unknown entry kind {kind!r} (one of {', '.join(_KINDS)})")
        limit = getattr(self.limits, kind)
        size = info.file_size
        if kind == "tensors":
            total = self.tensor_bytes + size
            if total > limit:
                raise ArchiveError(
                    f"torch_opaque: the tensor data of {self.description} exceeds the limit of "
                    f"{limit} bytes at entry '{name}' ({size} bytes; {total} in all). Raise it "
                    f"with limits=ArchiveLimits(tensors=...) if you trust the file."
                )
        if kind != "tensors" and size > limit:
            raise ArchiveError(
                f"torch_opaque: entry '{name}' in {self.description} inflates to {size} bytes, "
                f"more than the {kind} limit of {limit} bytes. Raise it with "
                f"limits=ArchiveLimits({kind}=...) if you trust the file."
            )
        if kind != "tensors" and self.metadata_bytes + size > self.limits.metadata:
            raise ArchiveError(
                f"torch_opaque: {self.description} holds more than {self.limits.metadata} bytes "
                f"of manifest, graphs and stored programs (at entry '{name}'). Raise it with "
                f"limits=ArchiveLimits(metadata=...) if you trust the file."
            )
        if size > MiB and size > info.compress_size * self.limits.ratio:
            raise ArchiveError(
                f"torch_opaque: entry '{name}' in {self.description} inflates {size} bytes from "
                f"{info.compress_size} (more than {self.limits.ratio} times): a zip bomb, or "
                f"raise limits=ArchiveLimits(ratio=...) if you trust the file."
            )
        return size

    def read(self, name: str, kind: str) -> bytes:
        """An entry's bytes, within the limits of its kind (Note [Size limits])."""
        size = self.check(name, kind)
        out = bytearray()
        try:
            with self.zf.open(self.infos[name]) as f:
                while len(out) <= size:
                    chunk = f.read(min(_CHUNK, size + 1 - len(out)))
                    if not chunk:
                        break
                    out += chunk
        except _ZIP_ERRORS as e:
            why = "fails its CRC check" if "CRC" in str(e) else f"cannot be inflated ({e})"
            raise ArchiveError(
                f"torch_opaque: cannot read {self.description}: {type(e).__name__}: entry "
                f"'{name}' {why}. The archive is truncated or corrupted."
            ) from e
        if len(out) != size:
            raise ArchiveError(
                f"torch_opaque: entry '{name}' in {self.description} holds {len(out)} bytes, "
                f"not the {size} its header says; the archive is truncated or corrupted."
            )
        if kind == "tensors":
            self.tensor_bytes += size
        else:
            self.metadata_bytes += size
        return bytes(out)

    def text(self, name: str, kind: str) -> str:
        raw = self.read(name, kind)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ArchiveError(
                f"torch_opaque: entry '{name}' in {self.description} is not UTF-8 text "
                f"({e}); the archive is corrupted."
            ) from e

    def close(self) -> None:
        if self.pos is None:
            self.file.close()
        else:
            self.file.seek(self.pos)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
