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
"""

from __future__ import annotations

import dataclasses
import os
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
            self.zf = zipfile.ZipFile(self.file)
            infos = self.zf.infolist()
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

    def _check_directory(self, infos) -> None:
        if len(infos) > self.limits.entries:
            raise ArchiveError(
                f"torch_opaque: {self.description} has {len(infos)} entries, more than the "
                f"limit of {self.limits.entries} (raise it with "
                f"limits=ArchiveLimits(entries=...) if you trust the file)."
            )
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
