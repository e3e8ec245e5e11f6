"""Exported programs that travel: ``torch_opaque.save`` / ``torch_opaque.load``.

A program exported with opaque ops names them (``torch.ops.opaque.Foo.Tensor``)
but does not contain them: ``torch.export.load`` in another process fails
unless something registered them first. ``torch_opaque.save`` writes a plain
``torch.export.save`` archive plus a JSON manifest (an ``extra_files`` entry)
that says, for each opaque op in the program, its overloads and schemas and
the module and class of the autograd.Function that defines it.
``torch_opaque.load`` reads the manifest first and re-registers missing ops:

* an op already registered in this process is reused (its schema must match);
* otherwise the defining module is imported, but only when the caller allows
  it: ``load(path, allow=["mymodule"])`` (module names or dotted prefixes) or
  ``allow_all=True``. Nothing is imported by default; a missing op whose
  module is not allowed is an :class:`OpNotAllowedError` that names the op,
  the module and the ``allow=`` to pass, raised before anything is imported;
* an archive saved with ``self_contained=True`` also stores, for each op, its
  forward and backward traced to ATen (see Note [Self-contained archives]); an
  op whose module is not allowed (or absent) is then re-created from them.

Example::

    >>> import torch, torch_opaque, tempfile, os
    >>> @torch_opaque.op(name="DocArchSin")
    ... class DocSin(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.sin()
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return g * x.cos()
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return DocSin.apply(x)
    >>> ep = torch.export.export(M(), (torch.randn(3),))
    >>> path = os.path.join(tempfile.mkdtemp(), "m.pt2")
    >>> torch_opaque.save(ep, path)
    >>> torch_opaque.load(path).module()(torch.zeros(3))   # the op exists here
    tensor([0., 0., 0.])

Note [Self-contained archives]
For every opaque op of the program, each distinct kind of call (overload,
values of the non-tensor arguments, dtypes, which dimensions are static) is
traced once with ``torch.export.export`` (non-strict) from concrete example
inputs whose sizes are the hints of the program's (possibly symbolic) sizes.
A dimension that is symbolic in the program is marked ``Dim.AUTO``, so the
stored programs stay dynamic where the program is (and specialise only where
the Function's code requires it); static dimensions stay static. Two programs
are stored per kind of call, as ``torch.export.save`` bytes (base64) in
``extra_files``:

* forward: (tensor arguments, symbolic int arguments) -> (outputs, residuals,
  symbolic ints the forward left on ctx); the rest of the forward record (which
  tensors are saved, non-differentiable outputs) is static and kept in the
  manifest;
* backward: (saved tensors, output gradients, those ints) -> gradients,
  traced with every tensor input needing a gradient (unneeded ones are
  dropped at run time).

Loading defines the op with ``_C.define_op`` whose kernels run these programs,
plus fake kernels (the same programs on fake tensors), so the loaded program
runs, re-exports and trains through the stored backward. A call that none of
the stored programs covers (other non-tensor values, dtypes, or other sizes
in a static dimension) fails with an error saying so.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import io
import json
import logging
import os
import re
import warnings
import zipfile
import zlib
from typing import Any, Iterable, Optional

import torch

from . import _C
from .ops import opaque_nodes

MANIFEST = "torch_opaque.json"
PROGRAM_PREFIX = "torch_opaque.program."
FORMAT = "torch_opaque.archive"
VERSION = 1

__all__ = ["save", "load", "ArchiveError", "OpNotAllowedError", "read_archive"]


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


def _schema_or_none(ns: str, name: str, overload: str):
    try:
        return torch._C._get_schema(f"{ns}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        return None


def _overload_exists(ns: str, name: str, overload: str) -> bool:
    return all(_schema_or_none(ns, name + s, overload) is not None for s in ("", "_fwd", "_bwd"))


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


# ---- save ---------------------------------------------------------------------------


def _graph_modules(ep) -> list:
    return [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]


@dataclasses.dataclass
class _OpRecord:
    namespace: str
    name: str
    function: Any  # OpaqueFunction or None
    overloads: dict = dataclasses.field(default_factory=dict)  # overload -> {"calls", "sites"}

    @property
    def qualified_name(self):
        return f"{self.namespace}::{self.name}"


def _collect(graph_modules, records: dict, count: bool) -> list:
    """Adds the opaque calls of these graphs to `records`; returns new op keys."""
    new = []
    for gm in graph_modules:
        for node, info in opaque_nodes(gm):
            key = (info.namespace, info.name)
            rec = records.get(key)
            if rec is None:
                rec = records[key] = _OpRecord(info.namespace, info.name, info.function)
                new.append(key)
            ov = rec.overloads.setdefault(
                info.overload, {"calls": {"op": 0, "fwd": 0, "bwd": 0}, "sites": []}
            )
            if count:
                ov["calls"][info.role] += 1
            ov["sites"].append((node, info))
    return new


def _definition(rec: _OpRecord) -> dict:
    """Manifest fields saying where the op comes from."""
    from .function import _BY_OPNAME

    fn = rec.function or _BY_OPNAME.get((rec.namespace, rec.name))
    stored = _STORED.get((rec.namespace, rec.name))
    if fn is not None:
        cls = fn.cls
        return {"module": cls.__module__, "class": cls.__qualname__, "defined_in": "python"}
    if stored is not None:
        return {
            "module": stored.entry.get("module"),
            "class": stored.entry.get("class"),
            "defined_in": "python",
        }
    return {"module": None, "class": None, "defined_in": "c++"}


def _overload_entry(rec: _OpRecord, overload: str) -> dict:
    from .function import _BY_OPNAME

    ns, name = rec.namespace, rec.name
    schema = _schema_or_none(ns, name, overload)
    entry = {
        "overload": overload,
        "schema": str(schema),
        "fwd_schema": str(_schema_or_none(ns, name + "_fwd", overload)),
        "bwd_schema": str(_schema_or_none(ns, name + "_bwd", overload)),
        "arguments": _arguments_of(str(schema)),
        "n_out": len(schema.returns),
        "returns_tuple": len(schema.returns) > 1,
        "calls": rec.overloads[overload]["calls"],
    }
    fn = rec.function or _BY_OPNAME.get((ns, name))
    py_ov = fn.overloads.get(overload) if fn is not None else None
    if py_ov is not None:
        entry["arguments"] = ", ".join(s.decl for s in py_ov.specs)
        entry["tokens"] = [s.token for s in py_ov.specs]
        entry["returns_tuple"] = py_ov.returns_tuple
        entry["n_out"] = py_ov.n_out
    else:
        stored = _STORED.get((ns, name))
        if stored is not None and overload in stored.entry_overloads:
            old = stored.entry_overloads[overload]
            for k in ("tokens", "returns_tuple"):
                if k in old:
                    entry[k] = old[k]
    return entry


def save(ep, path, *, self_contained: bool = False) -> None:
    """``torch.export.save`` plus a manifest of the program's opaque ops.

    ``self_contained=True`` also stores each op's forward and backward traced to
    ATen (Note [Self-contained archives]), so a process without the defining
    module can load, run and train the program. Raises ArchiveError naming the
    op when an op cannot be traced (and then writes nothing).
    """
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(
            f"torch_opaque.save expects a torch.export.ExportedProgram, got {type(ep).__name__}"
        )
    records: dict = {}
    worklist = _collect(_graph_modules(ep), records, count=True)
    files: dict = {}
    stored_entries: dict = {}  # (ns, name, overload) -> list of variants
    counter = [0]
    if self_contained:
        while worklist:
            key = worklist.pop(0)
            rec = records[key]
            for overload in list(rec.overloads):
                variants, programs = _store_overload(rec, overload, files, counter)
                stored_entries[(rec.namespace, rec.name, overload)] = variants
                worklist += _collect(programs, records, count=False)
    ops = []
    for key in sorted(records):
        rec = records[key]
        d = {"qualified_name": rec.qualified_name, "namespace": rec.namespace, "name": rec.name}
        d.update(_definition(rec))
        if d["module"] == "__main__" and not self_contained:
            warnings.warn(
                f"torch_opaque.save: {rec.qualified_name} is defined in __main__, which another "
                f"process cannot import; loading this archive elsewhere needs "
                f"torch_opaque.save(..., self_contained=True).",
                stacklevel=2,
            )
        d["overloads"] = []
        for overload in sorted(rec.overloads):
            entry = _overload_entry(rec, overload)
            if self_contained:
                entry["variants"] = stored_entries[(rec.namespace, rec.name, overload)]
            d["overloads"].append(entry)
        ops.append(d)
    from . import __version__

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "torch_version": torch.__version__,
        "torch_opaque_version": __version__,
        "self_contained": bool(self_contained),
        "ops": ops,
    }
    extra = {MANIFEST: json.dumps(manifest, indent=1, sort_keys=True)}
    extra.update(files)
    try:
        torch.export.save(ep, path, extra_files=extra)
    except RuntimeError as e:
        raise ArchiveError(f"torch_opaque.save: cannot write {_describe(path)}: {e}") from e


# ---- self-contained: tracing each kind of call ---------------------------------------


def _hint(v) -> int:
    if isinstance(v, int):
        return v
    node = v.node
    h = getattr(node, "hint", None)
    if h is not None:
        return int(h)
    env = getattr(node, "shape_env", None)
    if env is not None:
        try:
            h = env.size_hint(node.expr, allow_none=True)
        except Exception:
            h = None
        if h is not None:
            return int(h)
        subs = {}
        for s in node.expr.free_symbols:
            vr = env.var_to_range.get(s)
            lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 2
            subs[s] = max(lo, 2)
        try:
            return int(node.expr.xreplace(subs))
        except Exception:
            pass
    return 4


def _is_symbolic(v) -> bool:
    return isinstance(v, torch.SymInt) and not isinstance(v.node.maybe_as_int(), int)


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _tensor_sig(t) -> dict:
    return {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": [None if _is_symbolic(s) else int(s) for s in t.shape],
        "device": str(t.device),
    }


def _site_signature(schema, node) -> tuple:
    """(variant args description, example flat inputs, dynamic_shapes) of one call."""
    values = [_val(a) for a in _full_args(schema, node.args, node.kwargs)]
    desc, flat, dyn = [], [], []
    ints_flat, ints_dyn = [], []
    for arg, v in zip(schema.arguments, values):
        kind = _tensor_kind(arg)
        if kind == "tensor" and v is None:
            desc.append({"kind": "none"})
        elif kind == "tensor":
            desc.append({"kind": "tensor", **_tensor_sig(v)})
            flat.append(_example_tensor(v))
            dyn.append(_dims(v))
        elif kind == "tensors":
            items = []
            for t in v:
                if t is None:
                    raise ValueError(f"argument '{arg.name}' holds None inside a tensor list")
                items.append(_tensor_sig(t))
                flat.append(_example_tensor(t))
                dyn.append(_dims(t))
            desc.append({"kind": "tensors", "items": items})
        elif isinstance(v, torch.SymInt) and _is_symbolic(v):
            desc.append({"kind": "dyn"})
            ints_flat.append(_hint(v))
            ints_dyn.append(torch.export.Dim.AUTO)
        else:
            if isinstance(v, (torch.SymFloat, torch.SymBool)) or (
                isinstance(v, (list, tuple)) and any(_is_symbolic(x) for x in v)
            ):
                raise ValueError(
                    f"argument '{arg.name}' is symbolic ({v}); only tensors and single "
                    f"symbolic ints can vary in a stored program"
                )
            desc.append({"kind": "const", "value": _encode_value(_normalize_value(v, arg))})
    return desc, flat + ints_flat, dyn + ints_dyn


def _dims(t) -> Optional[dict]:
    d = {i: torch.export.Dim.AUTO for i, s in enumerate(t.shape) if _is_symbolic(s)}
    return d or None


def _example_tensor(t) -> torch.Tensor:
    shape = [_hint(s) for s in t.shape]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        gen = torch.Generator().manual_seed(len(shape) * 7919 + sum(shape))
        return torch.randn(shape, dtype=t.dtype, generator=gen).to(t.device)
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


class _ForwardTrace(torch.nn.Module):
    """The user's forward, as a module torch.export can trace: (flat tensors and
    symbolic ints) -> (outputs, residuals, state ints)."""

    def __init__(self, fn, overload, desc, report):
        super().__init__()
        from .kernels import Runner

        ov = fn.overloads[overload]
        setup = fn.cls.setup_context if fn.setup_style else None
        self.runner = Runner(fn.display_name, fn.cls.forward, setup, ov.specs, ov.n_out)
        self.runner.in_python = True  # clone residuals that alias inputs/outputs
        self.fn_name = fn.display_name
        self.desc = desc
        # torch.export restores state reachable from the module after tracing:
        # the record goes to a list the module does not reference.
        self._report = report

    def forward(self, flat):
        from .context import ForwardContext
        from .kernels import _unalias

        args = _rebuild_args(self.desc, list(flat))
        for i, conv in self.runner.convs:
            if args[i] is not None:
                args[i] = conv(args[i])
        needs = tuple(
            d["kind"] == "tensor" and args[i] is not None for i, d in enumerate(self.desc)
        )
        ctx = ForwardContext(self.fn_name, needs)
        outs = self.runner.outputs(self.runner.call_user(ctx, args, grad_off=False))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        outs = _unalias(outs, inputs)
        residuals, record = self.runner.record(ctx, args, outs)
        saved, non_diff, _materialize, state, state_ints = record
        self._report((list(saved), list(non_diff), state, len(state_ints)))
        return (*outs, *residuals, *state_ints)


class _BackwardTrace(torch.nn.Module):
    """The user's backward: (saved tensors, output grads, state ints) -> grads."""

    def __init__(self, fn, overload, saved_none, n_out, state, needs, report):
        super().__init__()
        from .kernels import FakeBackwardRunner

        ov = fn.overloads[overload]
        self.runner = FakeBackwardRunner(fn.display_name, fn.cls.backward, ov.specs)
        self.saved_none = saved_none
        self.n_out = n_out
        self.state = state
        self.needs = needs
        self._report = report  # the positions of non-None gradients (see _ForwardTrace)

    def forward(self, flat):
        flat = list(flat)
        saved = []
        for is_none in self.saved_none:
            saved.append(None if is_none else flat.pop(0))
        grads = flat[: self.n_out]
        ints = flat[self.n_out :]
        (res,) = self.runner(saved, grads, self.needs, self.state, ints)
        positions = [i for i, g in enumerate(res) if g is not None]
        self._report(positions)
        return tuple(res[i] for i in positions)


def _rebuild_args(desc, flat: list) -> list:
    """Operator arguments from a variant description and its flat program inputs."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    ints = [x for x in flat if not isinstance(x, torch.Tensor)]
    args = []
    for d in desc:
        k = d["kind"]
        if k == "none":
            args.append(None)
        elif k == "tensor":
            args.append(tensors.pop(0))
        elif k == "tensors":
            args.append([tensors.pop(0) for _ in d["items"]])
        elif k == "dyn":
            args.append(ints.pop(0))
        else:
            args.append(_decode_value(d["value"]))
    return args


def _program_bytes(prog) -> str:
    buf = io.BytesIO()
    torch.export.save(prog, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _export(module, flat, dyn, what: str):
    try:
        return torch.export.export(module, (flat,), dynamic_shapes=(dyn,), strict=False)
    except Exception as e:
        raise RuntimeError(f"torch.export of the {what} failed: {type(e).__name__}: {e}") from e


def _store_overload(rec: _OpRecord, overload: str, files: dict, counter: list) -> tuple:
    """(manifest variants, traced programs) for every kind of call of one overload."""
    stored = _STORED.get((rec.namespace, rec.name))
    if stored is not None and overload in stored.overloads:
        # Re-saving a program loaded from a self-contained archive: keep its programs.
        sov = stored.overloads[overload]
        variants = []
        for v in sov.variants:
            entry = dict(v.entry)
            for which in ("fwd", "bwd"):
                counter[0] += 1
                fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
                files[fname] = v.payload[which]
                entry[which] = fname
            variants.append(entry)
        return variants, []

    from .function import _BY_OPNAME

    fn = rec.function or _BY_OPNAME.get((rec.namespace, rec.name))
    qual = f"{rec.qualified_name}.{overload}"
    if fn is None or overload not in fn.overloads:
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): {qual} has no Python forward/backward "
            f"to trace (it is defined in C++); save without self_contained=True and load the "
            f"library that defines it before torch_opaque.load."
        )
    info = rec.overloads[overload]
    if info["calls"]["bwd"] or any(i.role == "bwd" for _, i in info["sites"]):
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): the program calls {rec.qualified_name}_bwd "
            f"(a training graph's backward); stored programs can only replace the forward "
            f"forms {rec.qualified_name} and {rec.qualified_name}_fwd."
        )
    schema = _op_overload(rec.namespace, rec.name, overload)._schema
    seen: dict = {}
    variants, programs = [], []
    for node, _info in info["sites"]:
        try:
            desc, flat, dyn = _site_signature(schema, node)
        except (ValueError, TypeError) as e:
            raise ArchiveError(
                f"torch_opaque.save(self_contained=True): cannot store {qual} (called at node "
                f"'{node.name}'): {e}."
            ) from e
        key = json.dumps(desc, sort_keys=True)
        if key in seen:
            continue
        seen[key] = True
        try:
            entry, fwd_prog, bwd_prog = _trace_variant(fn, overload, schema, desc, flat, dyn)
        except Exception as e:
            raise ArchiveError(
                f"torch_opaque.save(self_contained=True): cannot trace {qual} "
                f"({fn.cls.__module__}.{fn.cls.__qualname__}) to ATen for the call at node "
                f"'{node.name}': {e}. Save without self_contained=True (loading then imports "
                f"the defining module), or make forward/backward traceable."
            ) from e
        entry["id"] = len(variants)
        for which, prog in (("fwd", fwd_prog), ("bwd", bwd_prog)):
            counter[0] += 1
            fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
            files[fname] = _program_bytes(prog)
            entry[which] = fname
        variants.append(entry)
        programs += [fwd_prog.graph_module, bwd_prog.graph_module]
    return variants, programs


def _meta_dims(val) -> Optional[dict]:
    if isinstance(val, torch.Tensor):
        return _dims(val)
    if _is_symbolic(val):
        return torch.export.Dim.AUTO
    return None


def _trace_variant(fn, overload, schema, desc, flat, dyn) -> tuple:
    n_out = fn.overloads[overload].n_out
    records: list = []
    fwd_mod = _ForwardTrace(fn, overload, desc, lambda r: records.append(r))
    fwd_prog = _export(fwd_mod, flat, dyn, "forward")
    saved, non_diff, state, n_ints = records[-1]
    with torch.no_grad():
        res = list(fwd_prog.module()(flat))
    n_res = len(res) - n_out - n_ints
    outs, residuals, ints = res[:n_out], res[n_out : n_out + n_res], res[n_out + n_res :]

    # which flat program input / output holds each value (for dynamic dims)
    placeholders = [n for n in fwd_prog.graph.nodes if n.op == "placeholder"]
    user_inputs = [
        n for n in placeholders if n.name in set(fwd_prog.graph_signature.user_inputs)
    ]
    out_node = next(n for n in fwd_prog.graph.nodes if n.op == "output")
    out_vals = [_val(a) for a in out_node.args[0]]
    in_vals = [_val(n) for n in user_inputs]
    flat_pos = {}
    pos = 0
    for i, d in enumerate(desc):
        if d["kind"] == "tensor":
            flat_pos[(i, 0)] = pos
            pos += 1
        elif d["kind"] == "tensors":
            for j in range(len(d["items"])):
                flat_pos[(i, j)] = pos
                pos += 1
    args = _rebuild_args(desc, list(flat))

    b_flat, b_dyn, saved_none = [], [], []
    for k in range(0, len(saved), 3):
        kind, index, item = saved[k : k + 3]
        if kind == 0:
            saved_none.append(True)
            continue
        if kind == 1:
            t, meta = args[index], in_vals[flat_pos[(index, 0)]]
        elif kind == 2:
            t, meta = args[index][item], in_vals[flat_pos[(index, item)]]
        elif kind == 3:
            t, meta = outs[index], out_vals[index]
        else:
            t, meta = residuals[index], out_vals[n_out + index]
        if t is None:
            saved_none.append(True)
            continue
        saved_none.append(False)
        b_flat.append(t)
        b_dyn.append(_meta_dims(meta))
    for k, o in enumerate(outs):
        if o.dtype.is_floating_point or o.dtype.is_complex:
            b_flat.append(torch.randn_like(o))
        else:
            b_flat.append(torch.zeros_like(o))
        b_dyn.append(_meta_dims(out_vals[k]))
    for k, v in enumerate(ints):
        b_flat.append(int(v))
        b_dyn.append(_meta_dims(out_vals[n_out + n_res + k]))
    needs = [d["kind"] == "tensor" for d in desc]
    box: list = []
    bwd_mod = _BackwardTrace(fn, overload, saved_none, n_out, state, needs, box.append)
    bwd_prog = _export(bwd_mod, b_flat, b_dyn, "backward")
    if not box or any(p != box[0] for p in box):
        raise RuntimeError("the backward returns gradients for different inputs when traced")
    entry = {
        "args": desc,
        "n_residuals": n_res,
        "n_state_ints": n_ints,
        "saved": saved,
        "non_differentiable": non_diff,
        "grads": box[-1],
    }
    return entry, fwd_prog, bwd_prog


# ---- load: re-creating ops from stored programs ---------------------------------------


class _Variant:
    def __init__(self, entry: dict, payload: dict, schema):
        self.entry = entry
        self.payload = payload  # "fwd"/"bwd" -> base64 text (kept for re-saving)
        self.id = entry["id"]
        self.args = entry["args"]
        self.n_res = entry["n_residuals"]
        self.n_ints = entry["n_state_ints"]
        self.saved = [int(x) for x in entry["saved"]]
        self.saved_none = [self.saved[k] == 0 for k in range(0, len(self.saved), 3)]
        self.non_diff = [bool(x) for x in entry["non_differentiable"]]
        self.grads = [int(x) for x in entry["grads"]]
        self.schema = schema
        self.fwd = None
        self.bwd = None

    def deserialize(self, description: str, qual: str) -> None:
        for which in ("fwd", "bwd"):
            try:
                prog = torch.export.load(io.BytesIO(base64.b64decode(self.payload[which])))
                setattr(self, which, prog.module())
            except Exception as e:
                raise ArchiveError(
                    f"torch_opaque.load: the stored {which} program of {qual} in {description} "
                    f"cannot be read ({type(e).__name__}: {e}); the archive is corrupted."
                ) from e

    def match(self, args, fake: bool) -> Optional[list]:
        """The flat program inputs for this call, or None when not covered."""
        if len(args) != len(self.args):
            return None
        tensors, ints = [], []
        for d, v, arg in zip(self.args, args, self.schema.arguments):
            k = d["kind"]
            if k == "none":
                if v is not None:
                    return None
            elif k == "tensor":
                if not _tensor_matches(d, v, fake):
                    return None
                tensors.append(v)
            elif k == "tensors":
                if v is None or len(v) != len(d["items"]):
                    return None
                for item, t in zip(d["items"], v):
                    if not _tensor_matches(item, t, fake):
                        return None
                    tensors.append(t)
            elif k == "dyn":
                if not isinstance(v, (int, torch.SymInt)):
                    return None
                ints.append(v)
            else:
                try:
                    if _encode_value(_normalize_value(v, arg)) != d["value"]:
                        return None
                except TypeError:
                    return None
        return tensors + ints


def _tensor_matches(d: dict, t, fake: bool) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if str(t.dtype).replace("torch.", "") != d["dtype"] or t.dim() != len(d["shape"]):
        return False
    if fake:
        return True
    return all(s is None or s == n for s, n in zip(d["shape"], t.shape))


def _covered(variants) -> str:
    lines = []
    for v in variants:
        parts = []
        for d, a in zip(v.args, v.schema.arguments):
            k = d["kind"]
            if k == "tensor":
                shape = ", ".join("*" if s is None else str(s) for s in d["shape"])
                parts.append(f"{a.name}: {d['dtype']}[{shape}]")
            elif k == "tensors":
                parts.append(f"{a.name}: {len(d['items'])} tensors")
            elif k == "const":
                parts.append(f"{a.name}={_decode_value(d['value'])!r}")
            elif k == "none":
                parts.append(f"{a.name}=None")
            else:
                parts.append(f"{a.name}: any int")
        lines.append("(" + ", ".join(parts) + ")")
    return "; ".join(lines)


def _call_summary(schema, args) -> str:
    parts = []
    for a, v in zip(schema.arguments, args):
        if isinstance(v, torch.Tensor):
            parts.append(f"{a.name}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}")
        else:
            parts.append(f"{a.name}={v!r}")
    return "(" + ", ".join(parts) + ")"


class _StoredOverload:
    """Kernels of one overload re-created from stored programs."""

    def __init__(self, qual: str, overload: str, schema, n_out: int, variants: list):
        self.qual = qual
        self.overload = overload
        self.schema = schema
        self.n_out = n_out
        self.variants = variants

    def select(self, args, fake: bool):
        for v in self.variants:
            flat = v.match(args, fake)
            if flat is not None:
                return v, flat
        raise RuntimeError(
            f"torch_opaque: {self.qual}.{self.overload} was re-created from the stored programs "
            f"of a self-contained archive, which cover the calls {_covered(self.variants)}; "
            f"this call {_call_summary(self.schema, args)} is not one of them. Load the archive "
            f"with allow=[<defining module>] to run the original Function."
        )

    def split(self, v: _Variant, res):
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        n = self.n_out
        return res[:n], res[n : n + v.n_res], res[n + v.n_res :]

    # real kernels (called by the C++ bridge, Note [Python kernels])
    def forward_kernel(self, needs, *args):
        v, flat = self.select(args, fake=False)
        outs, residuals, ints = self.split(v, v.fwd(flat))
        if needs is None:
            return (*outs, [], None)
        return (*outs, residuals, (list(v.saved), list(v.non_diff), True, str(v.id), list(ints)))

    def backward_kernel(self, saved, grads, needs_input_grad, state, state_ints):
        v = self._variant_of_state(state)
        flat = [t for t, none in zip(saved, v.saved_none) if not none]
        if any(g is None for g in grads):
            raise RuntimeError(
                f"torch_opaque: {self.qual}.{self.overload} (re-created from stored programs) "
                f"got an undefined output gradient; its stored backward needs all of them."
            )
        out = v.bwd([*flat, *grads, *state_ints])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(v.grads, out):
            if needs_input_grad[pos]:
                res[pos] = g
        return (res,)

    def _variant_of_state(self, state: str) -> _Variant:
        try:
            return self.variants[int(state)]
        except (ValueError, IndexError):
            raise RuntimeError(
                f"torch_opaque: {self.qual}_bwd.{self.overload} (re-created from stored "
                f"programs) was called with state {state!r} that its forward did not produce; "
                f"a graph traced in the saving process cannot call the stored backward."
            ) from None

    # fake kernels (called from Python by PyTorch)
    def fake_fwd(self, *args, **kwargs):
        from .kernels import _unalias

        # `_fwd`'s last argument is needs_input_grad (none when called as the op).
        needs = kwargs.pop("needs_input_grad", None)
        if len(args) > len(self.schema.arguments):
            needs = args[len(self.schema.arguments)]
            args = args[: len(self.schema.arguments)]
        args = _full_args(self.schema, args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, residuals, ints = self.split(v, v.fwd.forward(flat))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        outs = list(_unalias(tuple(outs), inputs))
        residuals = list(_unalias(tuple(residuals), inputs + outs))
        if needs is not None:
            _C.set_forward_record(list(v.saved), list(v.non_diff), True, str(v.id), list(ints))
        return (*outs, residuals)

    def fake_op(self, *args, **kwargs):
        outs = self.fake_fwd(*args, **kwargs)[:-1]
        return outs[0] if len(outs) == 1 else outs

    def fake_bwd(self, saved, grads, needs_input_grad, state, state_ints):
        from .kernels import _unalias

        v = self._variant_of_state(state)
        flat = [t for t, none in zip(saved, v.saved_none) if not none]
        out = v.bwd.forward([*flat, *grads, *state_ints])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(v.grads, out):
            if needs_input_grad[pos]:
                res[pos] = g
        inputs = [t for t in (*saved, *grads) if t is not None]
        return list(_unalias(tuple(res), inputs))

    def decomposition(self, *args, **kwargs):
        """The forward as ATen ops (for passes.inline): runs the stored program."""
        args = _full_args(self.schema, args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, _, _ = self.split(v, v.fwd.forward(flat))
        return outs[0] if self.n_out == 1 else tuple(outs)


class _StoredOp:
    def __init__(self, entry: dict):
        self.entry = entry
        self.entry_overloads = {ov["overload"]: ov for ov in entry["overloads"]}
        self.overloads: dict = {}  # overload -> _StoredOverload
        self.libs: list = []


_STORED: dict = {}  # (namespace, name) -> _StoredOp, ops re-created from archives


def stored_overload(ns: str, name: str, overload: str) -> Optional[_StoredOverload]:
    """The re-created overload of an op loaded from a self-contained archive."""
    op = _STORED.get((ns, name))
    return None if op is None else op.overloads.get(overload)


def _define_stored(op_entry: dict, ov_entry: dict, texts: dict, description: str):
    ns, name = op_entry["namespace"], op_entry["name"]
    overload = ov_entry["overload"]
    qual = f"{ns}::{name}"
    n_out = ov_entry["n_out"]
    schema = torch._C.parse_schema(ov_entry["schema"])
    variants = [
        _Variant(e, {w: texts[e[w]] for w in ("fwd", "bwd")}, schema) for e in ov_entry["variants"]
    ]
    sov = _StoredOverload(qual, overload, schema, n_out, variants)
    _C.define_op(
        ns,
        name,
        "" if overload == "default" else overload,
        ov_entry["arguments"],
        ["Tensor"] * n_out,
        sov.forward_kernel,
        sov.backward_kernel,
    )
    defined = str(_schema_or_none(ns, name, overload))
    if defined != ov_entry["schema"]:
        raise ValueError(f"its arguments define {defined}, not {ov_entry['schema']}")
    stored = _STORED.get((ns, name))
    if stored is None:
        stored = _STORED[(ns, name)] = _StoredOp(op_entry)
    lib = torch.library.Library(ns, "FRAGMENT")
    stored.libs.append(lib)
    torch.library.register_fake(_op_overload(ns, name, overload), sov.fake_op, lib=lib)
    torch.library.register_fake(_op_overload(ns, name + "_fwd", overload), sov.fake_fwd, lib=lib)
    torch.library.register_fake(_op_overload(ns, name + "_bwd", overload), sov.fake_bwd, lib=lib)
    stored.overloads[overload] = sov
    return sov


# ---- load: re-registering ops from their modules -----------------------------------------

_EXAMPLES = {
    "Tensor": lambda: torch.empty(0),
    "None": lambda: None,
    "bool": lambda: False,
    "int": lambda: 0,
    "float": lambda: 0.0,
    "str": lambda: "",
    "dtype": lambda: torch.float32,
    "device": lambda: torch.device("cpu"),
    "size": lambda: torch.Size([]),
    "Tensors": lambda: [torch.empty(0)],
    "tTensors": lambda: (torch.empty(0),),
    "bools": lambda: [False],
    "tbools": lambda: (False,),
    "ints": lambda: [],
    "tints": lambda: (),
    "floats": lambda: [0.0],
    "tfloats": lambda: (0.0,),
}


def _define_python_overload(fn, ov_entry: dict, description: str) -> None:
    """Defines a recorded overload of a registered Function without calling it
    (OpaqueFunction.overload_for would probe the forward with example values)."""
    from . import function as F
    from .schema import kinds_key, specs_from_values

    overload = ov_entry["overload"]
    qual = f"{fn.namespace}::{fn.name}.{overload}"
    with F._LOCK:
        if overload in fn.overloads:
            return
        if fn.hint_specs is not None:
            specs, name, values = fn.hint_specs, "", None
        else:
            tokens = ov_entry.get("tokens")
            if tokens is None or any(t not in _EXAMPLES for t in tokens):
                raise ArchiveError(
                    f"torch_opaque.load: {description} does not say how to define {qual} "
                    f"from {fn.cls.__module__}.{fn.cls.__qualname__}."
                )
            values = [_EXAMPLES[t]() for t in tokens]
            names = (
                [f"arg{i}" for i in range(len(values))] if fn.varargs else fn.arg_names
            )
            if len(names) != len(values):
                raise ArchiveError(
                    f"torch_opaque.load: {fn.cls.__module__}.{fn.cls.__qualname__} no longer "
                    f"takes the arguments of {qual} as saved in {description} "
                    f"({ov_entry['schema']})."
                )
            specs = specs_from_values(names, values, fn.defaults, fn.display_name)
            name = "_".join(s.token for s in specs) or "noargs"
        if (name or "default") != overload or ", ".join(s.decl for s in specs) != ov_entry[
            "arguments"
        ]:
            raise ArchiveError(
                f"torch_opaque.load: {fn.cls.__module__}.{fn.cls.__qualname__} now defines "
                f"{fn.namespace}::{fn.name}.{name or 'default'}"
                f"({', '.join(s.decl for s in specs)}), but {description} was saved with "
                f"{ov_entry['schema']}; the Function changed since the archive was written."
            )
        ov = F.Overload(fn, name, specs, ov_entry["n_out"], bool(ov_entry.get("returns_tuple")))
        fn.overloads[ov.name] = ov
        if values is not None:
            fn._by_kinds[kinds_key(values)] = ov
        else:
            fn._single = ov


def _allowed(module: Optional[str], allow: list, allow_all: bool) -> bool:
    if module is None or module == "__main__":
        return False
    if allow_all:
        return True
    for p in allow:
        p = p[:-2] if p.endswith(".*") else p.rstrip(".")
        if module == p or module.startswith(p + "."):
            return True
    return False


def _resolve_class(module, qualname: Optional[str]):
    if not qualname or "<locals>" in qualname:
        return None
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _register_from_module(op_entry: dict, missing: list, description: str) -> None:
    from . import function as F

    ns, name, module_name = op_entry["namespace"], op_entry["name"], op_entry["module"]
    module = importlib.import_module(module_name)
    fn = F._BY_OPNAME.get((ns, name))
    if fn is None:
        cls = _resolve_class(module, op_entry.get("class"))
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise ArchiveError(
                f"torch_opaque.load: {description} needs {ns}::{name}, defined by class "
                f"{op_entry.get('class')} in module {module_name}; the module was imported but "
                f"has no such autograd.Function."
            )
        existing = F.lookup(cls)
        if existing is not None and (existing.namespace, existing.name) != (ns, name):
            raise ArchiveError(
                f"torch_opaque.load: {module_name}.{op_entry.get('class')} is now the op "
                f"{existing.namespace}::{existing.name}, but {description} calls it {ns}::{name}."
            )
        F.wrap(cls, name=name, namespace=ns, _patch_apply=False)
        fn = F._BY_OPNAME[(ns, name)]
    for ov_entry in missing:
        _define_python_overload(fn, ov_entry, description)


def _missing_message(description: str, path_repr: str, problems: list, allow: list) -> str:
    lines = [
        f"torch_opaque.load: {description} calls opaque ops that are not registered in this "
        f"process, and loading may not import the modules that define them:"
    ]
    modules = []
    for op_entry, why in problems:
        mod = op_entry.get("module")
        cls = op_entry.get("class")
        where = f"class {cls} in module {mod}" if mod else "C++ (no Python module)"
        lines.append(f"  - {op_entry['namespace']}::{op_entry['name']}: defined by {where}; {why}")
        if mod and mod != "__main__" and mod not in modules:
            modules.append(mod)
    if modules:
        suggestion = sorted(set(allow) | set(modules))
        lines.append(
            f"Allow the import with torch_opaque.load({path_repr}, allow={suggestion!r}) "
            f"(or import those modules yourself first). Only allow modules you trust: "
            f"importing runs their code."
        )
    lines.append("Nothing was imported.")
    return "\n".join(lines)


def _prepare_ops(manifest: dict, path, description: str, allow: list, allow_all: bool) -> None:
    """Makes every op the manifest names available, importing only allowed modules.
    Decides everything before importing anything."""
    from . import function as F

    plan = []  # (action, op_entry, missing overload entries)
    problems = []
    for op_entry in manifest["ops"]:
        ns, name = op_entry["namespace"], op_entry["name"]
        missing = []
        for ov_entry in op_entry["overloads"]:
            overload = ov_entry["overload"]
            if _overload_exists(ns, name, overload):
                have = str(_schema_or_none(ns, name, overload))
                if have != ov_entry["schema"]:
                    raise ArchiveError(
                        f"torch_opaque.load: {description} calls {ov_entry['schema']}, but this "
                        f"process already defines {have}."
                    )
            else:
                missing.append(ov_entry)
        if not missing:
            continue
        module = op_entry.get("module")
        stored = all(ov.get("variants") for ov in missing)
        if (ns, name) in F._BY_OPNAME:
            plan.append(("registered", op_entry, missing))
        elif _allowed(module, allow, allow_all):
            plan.append(("import", op_entry, missing))
        elif stored:
            plan.append(("stored", op_entry, missing))
        elif module is None:
            problems.append((op_entry, "load the library that defines it before loading"))
        elif module == "__main__":
            problems.append(
                (
                    op_entry,
                    "it was defined in the saving script (__main__), which cannot be imported; "
                    "save with torch_opaque.save(ep, path, self_contained=True) or define it in "
                    "a module",
                )
            )
        elif allow or allow_all:
            problems.append((op_entry, f"module {module} is not in allow={list(allow)!r}"))
        else:
            problems.append((op_entry, "no module may be imported (allow is empty)"))
    if problems:
        path_repr = repr(description) if isinstance(path, (str, os.PathLike)) else "f"
        raise OpNotAllowedError(_missing_message(description, path_repr, problems, allow))

    texts: dict = {}
    wanted = [
        e[w]
        for action, _op, missing in plan
        for ov in missing
        for e in ov.get("variants", [])
        for w in ("fwd", "bwd")
    ]
    if wanted:
        texts = _read_extra(path, description, wanted)

    created = []
    for action, op_entry, missing in plan:
        if action == "registered":
            fn = F._BY_OPNAME[(op_entry["namespace"], op_entry["name"])]
            for ov_entry in missing:
                _define_python_overload(fn, ov_entry, description)
            continue
        if action == "import":
            try:
                _register_from_module(op_entry, missing, description)
                continue
            except ImportError as e:
                if not all(ov.get("variants") for ov in missing):
                    raise ArchiveError(
                        f"torch_opaque.load: {description} needs "
                        f"{op_entry['namespace']}::{op_entry['name']} from module "
                        f"{op_entry['module']}, which cannot be imported "
                        f"({type(e).__name__}: {e})."
                    ) from e
                warnings.warn(
                    f"torch_opaque.load: cannot import {op_entry['module']} ({e}); "
                    f"{op_entry['namespace']}::{op_entry['name']} runs the programs stored in "
                    f"{description} instead.",
                    stacklevel=3,
                )
        for ov_entry in missing:
            try:
                created.append(_define_stored(op_entry, ov_entry, texts, description))
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
                raise _bad_manifest(
                    description,
                    f"the stored programs of {op_entry['namespace']}::{op_entry['name']}."
                    f"{ov_entry['overload']} are described wrongly ({type(e).__name__}: {e})",
                ) from e
    # Deserialize the stored programs once every op (they may call each other) exists.
    for sov in created:
        for v in sov.variants:
            v.deserialize(description, f"{sov.qual}.{sov.overload}")


def _check_plain(contents: ArchiveContents) -> None:
    unknown = []
    for target in sorted(contents.custom_targets()):
        _, _, ns, name, overload = target.split(".")
        if _schema_or_none(ns, name, overload) is None:
            unknown.append(f"{ns}::{name}.{overload}")
    if unknown:
        raise ArchiveError(
            f"torch_opaque.load: {contents.path} was written by torch.export.save (it has no "
            f"torch_opaque manifest) and calls operators that are not registered in this "
            f"process: {', '.join(unknown)}. It does not say which module defines them, so "
            f"nothing is imported: import the modules that define them first (and save with "
            f"torch_opaque.save next time)."
        )


class _CaptureLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list = []

    def emit(self, record):
        self.records.append(record)


def _torch_load(path, description: str):
    logger = logging.getLogger("torch.export")
    capture = _CaptureLog()
    propagate = logger.propagate
    logger.addHandler(capture)
    logger.propagate = False
    try:
        if hasattr(path, "seek"):
            path.seek(0)
        return torch.export.load(path)
    except Exception as e:
        cause: BaseException = e
        for r in capture.records:
            if r.exc_info and r.exc_info[1] is not None:
                cause = r.exc_info[1]
        raise ArchiveError(
            f"torch_opaque.load: cannot load the exported program in {description}: "
            f"{type(cause).__name__}: {cause}"
        ) from cause
    finally:
        logger.removeHandler(capture)
        logger.propagate = propagate


def load(path, *, allow: Iterable[str] = (), allow_all: bool = False):
    """``torch.export.load`` that first re-registers the program's opaque ops.

    ``allow``: modules (or dotted prefixes: ``"mypkg"`` allows ``"mypkg.ops"``)
    that may be imported to define missing ops; ``allow_all=True`` allows any.
    Nothing is imported otherwise: a missing op raises OpNotAllowedError (before
    anything is imported) unless the archive is self-contained, in which case
    the op is re-created from its stored programs. Corrupted or truncated files
    raise ArchiveError naming the file and the cause.
    """
    if isinstance(allow, str):
        allow = [allow]
    allow = list(allow)
    for a in allow:
        if not isinstance(a, str) or not _MODULE_RE.match(
            a[:-2] if a.endswith(".*") else a.rstrip(".")
        ):
            raise ValueError(f"torch_opaque.load: allow entries are module names, got {a!r}")
    description = _describe(path)
    contents = read_archive(path, verify=True)
    if contents.manifest is None:
        _check_plain(contents)
    else:
        _prepare_ops(contents.manifest, path, description, allow, allow_all)
    return _torch_load(path, description)
