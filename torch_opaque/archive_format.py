"""The torch_opaque archive format: errors, manifest and zip reading (no loading).

Used by :mod:`torch_opaque.archive` (save/load) and :mod:`torch_opaque.cli`
(inspection without importing anything).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zipfile
import zlib
from typing import Any, Iterable, Optional

import torch

from .ops import is_opaque_triple, schema_or_none




MANIFEST = "torch_opaque.json"
PROGRAM_PREFIX = "torch_opaque.program."
FORMAT = "torch_opaque.archive"
VERSION = 1


class ArchiveError(RuntimeError):
    """An archive cannot be written or read (corrupted, truncated, invalid
    manifest, ops that cannot be restored)."""


class OpNotAllowedError(ArchiveError):
    """The archive needs ops whose defining modules ``load`` may not import."""


# ---- small helpers ----------------------------------------------------------------

_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_QUALNAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _describe(path) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    return f"<{type(path).__name__}>"


def _packet(ns: str, name: str):
    return getattr(getattr(torch.ops, ns), name)


_schema_or_none = schema_or_none
_overload_exists = is_opaque_triple


def _op_overload(ns: str, name: str, overload: str):
    return getattr(_packet(ns, name), overload)


def _arguments_of(schema_str: str) -> str:
    """The argument list of a schema string: 'ns::N.o(Tensor x, float s) -> Tensor'."""
    return schema_str[schema_str.index("(") + 1 : schema_str.rindex(") ->")]


def _tensor_kind(arg) -> str:
    """'tensor' (Tensor / Tensor?), 'tensors' (Tensor[] / Tensor?[]) or 'value'."""
    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return "tensor"
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        if isinstance(e, torch.OptionalType):
            e = e.getElementType()
        if isinstance(e, torch.TensorType):
            return "tensors"
    return "value"


def _full_args(schema, args, kwargs) -> list:
    """All arguments of a call by position (keywords and schema defaults filled in)."""
    out = list(args)
    for a in schema.arguments[len(out) :]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TypeError(f"{schema.name}: missing argument '{a.name}'")
    return out


def _encode_value(v: Any) -> Any:
    """A JSON-able, comparable encoding of a non-tensor argument value."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, torch.SymBool):
        v = bool(v)
        return v
    if isinstance(v, (int, torch.SymInt)):
        return int(v)
    if isinstance(v, (float, torch.SymFloat)):
        return {"float": repr(float(v))}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).replace("torch.", "")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).replace("torch.", "")}
    if isinstance(v, (list, tuple)):
        return [_encode_value(x) for x in v]
    raise TypeError(f"cannot store a {type(v).__name__} argument")


def _decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_value(x) for x in v]
    if isinstance(v, dict):
        ((tag, body),) = v.items()
        if tag == "float":
            return float(body)
        if tag in ("dtype", "layout", "memory_format"):
            return getattr(torch, body)
        if tag == "device":
            return torch.device(body)
        raise ValueError(f"unknown value tag {tag!r}")
    return v


def _normalize_value(v: Any, arg) -> Any:
    """A value as the kernel of this schema argument receives it."""
    t = arg.type
    if v is None:
        return None
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.FloatType) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        items = list(v)
        if isinstance(e, torch.FloatType):
            return [float(x) if isinstance(x, (int, float)) else x for x in items]
        return items
    return v


# ---- reading archives (without loading the program) --------------------------------


@dataclasses.dataclass
class ArchiveContents:
    """What :func:`read_archive` finds in a .pt2 file, without deserializing it."""

    path: str
    manifest: Optional[dict]  # None for plain torch.export archives
    models: dict  # model name -> parsed models/<name>.json
    extra_names: list  # extra file names

    def custom_targets(self) -> dict:
        """'torch.ops.ns.name.overload' -> call count, for every operator outside
        aten / prims in the serialized graphs (nested graphs included)."""
        counts: dict = {}
        for model in self.models.values():
            for node in _json_nodes(model):
                target = node.get("target")
                if not isinstance(target, str) or not target.startswith("torch.ops."):
                    continue
                parts = target.split(".")
                if len(parts) != 5 or parts[2] in ("aten", "prims", "higher_order"):
                    continue
                counts[target] = counts.get(target, 0) + 1
        return counts


def _json_nodes(obj):
    """Every serialized node (dict with 'target' and 'inputs') in a model JSON."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if "target" in o and "inputs" in o and "outputs" in o:
                yield o
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


_ZIP_ERRORS = (
    OSError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    ValueError,
    zlib.error,
    NotImplementedError,
)


class _Zip:
    """A zip archive read entry by entry; errors become ArchiveError naming the
    file. A missing file stays a plain FileNotFoundError."""

    def __init__(self, path, description: str, verify: bool = False):
        self.description = description
        self.path = path
        if isinstance(path, (str, os.PathLike)):
            self.file = open(path, "rb")
            self.pos = None
        else:
            self.file = path
            self.pos = path.tell() if hasattr(path, "tell") else None
        try:
            self.zf = zipfile.ZipFile(self.file)
            self.names = self.zf.namelist()
            bad = self.zf.testzip() if verify else None  # reads every entry, CRC-checked
            if bad is not None:
                raise zipfile.BadZipFile(f"entry '{bad}' fails its CRC check")
        except _ZIP_ERRORS as e:
            self.close()
            raise ArchiveError(
                f"torch_opaque: cannot read {description}: {type(e).__name__}: {e}. The file "
                f"is truncated or corrupted, or is not a .pt2 archive written by "
                f"torch.export.save / torch_opaque.save."
            ) from e

    def read(self, name: str) -> bytes:
        try:
            return self.zf.read(name)
        except _ZIP_ERRORS + (KeyError,) as e:
            raise ArchiveError(
                f"torch_opaque: cannot read '{name}' in {self.description}: "
                f"{type(e).__name__}: {e}. The archive is truncated or corrupted."
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


def read_archive(path, verify: bool = False) -> ArchiveContents:
    """The manifest and serialized graphs of a .pt2 archive, read as data: nothing
    is deserialized and no module is imported. ``verify`` checks every entry's
    CRC (a corrupted archive fails here, before anything is imported)."""
    description = _describe(path)
    manifest = None
    models = {}
    extra = []
    with _Zip(path, description, verify) as z:
        for name in z.names:
            parts = name.split("/")
            if len(parts) >= 3 and parts[-2] == "extra":
                extra.append(parts[-1])
                if parts[-1] == MANIFEST:
                    manifest = _parse_manifest(z.read(name), description)
            elif len(parts) == 3 and parts[1] == "models" and parts[2].endswith(".json"):
                try:
                    models[parts[2][: -len(".json")]] = json.loads(z.read(name))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ArchiveError(
                        f"torch_opaque: the serialized graph '{name}' in {description} is "
                        f"corrupted ({type(e).__name__}: {e})."
                    ) from e
    if not models and manifest is None:
        raise ArchiveError(
            f"torch_opaque: {description} holds no exported program (no models/*.json): "
            f"it is not a .pt2 archive written by torch.export.save / torch_opaque.save."
        )
    return ArchiveContents(description, manifest, models, extra)


def _read_extra(path, description: str, names: Iterable[str]) -> dict:
    wanted = set(names)
    out = {}
    with _Zip(path, description) as z:
        for n in z.names:
            parts = n.split("/")
            if len(parts) >= 3 and parts[-2] == "extra" and parts[-1] in wanted:
                try:
                    out[parts[-1]] = z.read(n).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ArchiveError(
                        f"torch_opaque: the stored program '{n}' in {description} is "
                        f"corrupted ({e})."
                    ) from e
    missing = wanted - set(out)
    if missing:
        raise ArchiveError(
            f"torch_opaque: {description} lacks the stored programs {sorted(missing)} that its "
            f"manifest names; the archive is truncated or corrupted."
        )
    return out


def _bad_manifest(description: str, why: str) -> ArchiveError:
    return ArchiveError(
        f"torch_opaque: the manifest ({MANIFEST}) in {description} is corrupted or invalid: "
        f"{why}."
    )


def _parse_manifest(raw: bytes, description: str) -> dict:
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_manifest(description, f"{type(e).__name__}: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise _bad_manifest(description, f"it does not say format '{FORMAT}'")
    if not isinstance(m.get("version"), int) or m["version"] > VERSION:
        raise _bad_manifest(
            description,
            f"version {m.get('version')!r} is not one this torch_opaque reads (<= {VERSION}); "
            f"upgrade torch_opaque",
        )
    ops = m.get("ops")
    if not isinstance(ops, list):
        raise _bad_manifest(description, "'ops' is not a list")
    for op in ops:
        if not isinstance(op, dict):
            raise _bad_manifest(description, "an entry of 'ops' is not an object")
        for key in ("namespace", "name"):
            if not isinstance(op.get(key), str) or not re.match(r"^\w+$", op[key]):
                raise _bad_manifest(description, f"op entry has an invalid {key} {op.get(key)!r}")
        module = op.get("module")
        if module is not None and (not isinstance(module, str) or not _MODULE_RE.match(module)):
            raise _bad_manifest(
                description, f"op {op['namespace']}::{op['name']} names an invalid module {module!r}"
            )
        cls = op.get("class")
        if cls is not None and (not isinstance(cls, str) or not _QUALNAME_RE.match(cls)):
            if not (isinstance(cls, str) and "<locals>" in cls):
                raise _bad_manifest(
                    description, f"op {op['namespace']}::{op['name']} names an invalid class {cls!r}"
                )
        ovs = op.get("overloads")
        if not isinstance(ovs, list) or not ovs:
            raise _bad_manifest(description, f"op {op['namespace']}::{op['name']} has no overloads")
        for ov in ovs:
            if not isinstance(ov, dict) or not isinstance(ov.get("overload"), str):
                raise _bad_manifest(description, "an overload entry is malformed")
            if not isinstance(ov.get("schema"), str) or not isinstance(ov.get("arguments"), str):
                raise _bad_manifest(description, "an overload entry lacks its schema")
            if not isinstance(ov.get("n_out"), int) or ov["n_out"] < 1:
                raise _bad_manifest(description, "an overload entry lacks its output count")
            if not isinstance(ov.get("variants", []), list):
                raise _bad_manifest(description, "an overload's 'variants' is not a list")
    return m




@dataclasses.dataclass
class _OpRecord:
    namespace: str
    name: str
    function: Any  # OpaqueFunction or None
    overloads: dict = dataclasses.field(default_factory=dict)  # overload -> {"calls", "sites"}

    @property
    def qualified_name(self):
        return f"{self.namespace}::{self.name}"
