"""The pt2 layout's own format and version entries, checked before anything
else of an archive is read.

Note [Archive versions]
torch.export.save writes the pt2 layout's format (``archive_format``:
``pt2``) and version (``archive_version``: ``0``) at the archive's root, and
torch.export.load refuses any other version. torch_opaque reads only the
values it knows, and refuses by name, with the values it reads, an archive
whose entries say another format or version, and one that lacks either
entry: every torch release that torch_opaque supports writes both (in its
own archives and in the stored programs of self-contained ones, and the
archives of tests/fixtures, the oldest torch_opaque wrote, hold both), so a
missing entry is a file that was not written by torch.export.save, not an
older format to be guessed at. torch reads a missing version as 0; this is
the one place torch_opaque is stricter. The manifest's own version is
checked in manifest.py.

Example::

    >>> import io, zipfile
    >>> from torch_opaque.archive.zipio import ArchiveLimits, ZipReader
    >>> buf = io.BytesIO()
    >>> with zipfile.ZipFile(buf, "w") as z:
    ...     z.writestr("a/archive_format", "pt2")
    >>> with ZipReader(io.BytesIO(buf.getvalue()), "a.pt2", ArchiveLimits()) as r:
    ...     check_archive_version(r, "a/")
    Traceback (most recent call last):
    ...
    torch_opaque.errors.ArchiveError: torch_opaque: a.pt2 has no pt2 archive version (no entry 'a/archive_version'); torch_opaque reads the versions '0' (what torch.export.save writes). It was not written by torch.export.save or torch_opaque.save: save the program again with torch_opaque.save.
"""

from __future__ import annotations

from ..errors import ArchiveError

ARCHIVE_FORMATS = ("pt2",)
ARCHIVE_VERSIONS = ("0",)


def check_archive_version(z, root: str) -> None:
    """Note [Archive versions]: `z` a ZipReader, `root` the archive's folder."""
    for entry, known, what in (
        ("archive_format", ARCHIVE_FORMATS, "format"),
        ("archive_version", ARCHIVE_VERSIONS, "version"),
    ):
        name = root + entry
        reads = f"torch_opaque reads the {what}s {', '.join(map(repr, known))} (what torch.export.save writes)"
        if name not in z.infos:
            raise ArchiveError(
                f"torch_opaque: {z.description} has no pt2 archive {what} (no entry '{name}'); "
                f"{reads}. It was not written by torch.export.save or torch_opaque.save: save "
                f"the program again with torch_opaque.save."
            )
        if z.infos[name].file_size > 64:
            value = f"<{z.infos[name].file_size} bytes>"
        else:
            value = z.read(name, "other").decode("utf-8", "replace").strip()
        if value not in known:
            raise ArchiveError(
                f"torch_opaque: {z.description} says its pt2 archive {what} is {value[:40]!r} "
                f"('{name}'); {reads}. Save the program again with torch_opaque.save, or load "
                f"it with the torch that wrote it."
            )
