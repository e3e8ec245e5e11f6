"""What a .pt2 archive holds, read as data: the manifest (typed records), the
serialized graphs (JSON) and the names of the extra files. Used by ``load``
and by ``python -m torch_opaque inspect``; nothing is deserialized, unpickled
or imported here.

Example::

    >>> from torch_opaque.archive.reader import read_archive
    >>> read_archive("missing.pt2")
    Traceback (most recent call last):
    ...
    FileNotFoundError: [Errno 2] No such file or directory: 'missing.pt2'
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import ArchiveError
from .manifest import MANIFEST, Manifest, parse_manifest
from .program import EXTRA_DIR, archive_root, model_names, read_model_json
from .versions import check_archive_version
from .zipio import ArchiveLimits, ZipReader, describe


@dataclasses.dataclass
class ArchiveContents:
    """What :func:`read_archive` finds in a .pt2 file, without deserializing it."""

    path: str
    root: str  # the folder of every entry, 'name/'
    manifest: Optional[Manifest]  # None for plain torch.export archives
    models: dict  # model name -> parsed models/<name>.json
    extra: dict  # extra file name -> zip entry name

    def custom_targets(self) -> dict:
        """'torch.ops.ns.name.overload' -> call count, for every operator outside
        aten / prims in the serialized graphs (nested graphs included)."""
        counts: dict = {}
        for model in self.models.values():
            for node in json_nodes(model):
                target = node.get("target")
                if not isinstance(target, str) or not target.startswith("torch.ops."):
                    continue
                parts = target.split(".")
                if len(parts) != 5 or parts[2] in ("aten", "prims", "higher_order"):
                    continue
                counts[target] = counts.get(target, 0) + 1
        return counts


def json_nodes(obj):
    """Every serialized node (dict with 'target', 'inputs', 'outputs') in a model JSON."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if "target" in o and "inputs" in o and "outputs" in o:
                yield o
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def read_contents(z: ZipReader) -> ArchiveContents:
    root = archive_root(z)
    check_archive_version(z, root)
    manifest = None
    extra = {}
    for name in z.names:
        rest = name[len(root) :]
        if rest.startswith(EXTRA_DIR) and "/" not in rest[len(EXTRA_DIR) :]:
            extra[rest[len(EXTRA_DIR) :]] = name
    if MANIFEST in extra:
        manifest = parse_manifest(z.read(extra[MANIFEST], "manifest"), z.description)
    models = {m: read_model_json(z, root, m, z.description) for m in model_names(z, root)}
    if not models:
        raise ArchiveError(
            f"torch_opaque: {z.description} holds no exported program (no models/*.json): "
            f"it is not a .pt2 archive written by torch.export.save / torch_opaque.save."
        )
    return ArchiveContents(z.description, root, manifest, models, extra)


def read_archive(path, limits: Optional[ArchiveLimits] = None) -> ArchiveContents:
    """The manifest and serialized graphs of a .pt2 archive, read as data within
    ``limits`` (Note [Size limits]): nothing is deserialized, no module imported."""
    with ZipReader(path, describe(path), limits or ArchiveLimits()) as z:
        return read_contents(z)
