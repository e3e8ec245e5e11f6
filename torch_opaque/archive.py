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

import importlib
import json
import logging
import os
import warnings
from typing import Iterable, Optional

import torch

from .archive_format import (
    FORMAT,
    MANIFEST,
    VERSION,
    ArchiveContents,
    ArchiveError,
    OpNotAllowedError,
    _MODULE_RE,
    _arguments_of,
    _bad_manifest,
    _describe,
    _OpRecord,
    _overload_exists,
    _read_extra,
    _schema_or_none,
    read_archive,
)
from .ops import opaque_nodes
from .schema import schema_arguments
from .stored_ops import _STORED, _define_stored, _store_overload



# ---- save ---------------------------------------------------------------------------


def _graph_modules(ep) -> list:
    return [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]


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
        entry["arguments"] = schema_arguments(py_ov.specs)
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
        if (name or "default") != overload or schema_arguments(specs) != ov_entry[
            "arguments"
        ]:
            raise ArchiveError(
                f"torch_opaque.load: {fn.cls.__module__}.{fn.cls.__qualname__} now defines "
                f"{fn.namespace}::{fn.name}.{name or 'default'}"
                f"({schema_arguments(specs)}), but {description} was saved with "
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
