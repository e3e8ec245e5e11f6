"""``torch_opaque.save``: ``torch.export.save`` plus the manifest of the program's
opaque ops (and, self-contained, their programs traced to ATen)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from ..errors import ArchiveError
from ..ops import opaque_info, opaque_nodes, schema_or_none
from ..passes import _graph_modules  # (a graph module and its HOPs' subgraphs)
from .._impl.registry import function_for_op
from .._impl.schema import schema_arguments
from . import stored as S
from .fingerprint import function_fingerprint
from .manifest import MANIFEST, Calls, Manifest, OpEntry, OverloadRecord
from .trace import store_overload
from .readback import write_checked


@dataclasses.dataclass
class _OpCalls:
    """The calls of one opaque op found in the program being saved."""

    namespace: str
    name: str
    function: Any  # OpaqueFunction or None
    overloads: dict = dataclasses.field(default_factory=dict)  # overload -> {"calls", "sites"}

    @property
    def qualified_name(self):
        return f"{self.namespace}::{self.name}"

    def overload_packet(self, overload: str):
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), overload)


# The higher-order ops that functionalization wraps a mutating op's call in
# (run_decompositions of a program calling an in-place op): the op is their
# first argument.
_FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")


def _calls(gm) -> list:
    """(node, OpaqueInfo) of the opaque calls of a graph, those of in-place ops
    inside ``auto_functionalized`` nodes included."""
    calls = opaque_nodes(gm)
    for node in gm.graph.nodes:
        target = node.target
        if (node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator)
                and target.name() in _FUNCTIONALIZED and node.args):
            info = opaque_info(node.args[0])
            if info is not None:
                calls.append((node, info))
    return calls


def _collect(graph_modules, records: dict, count: bool) -> list:
    """Adds the opaque calls of these graphs to `records`; returns new op keys."""
    new = []
    for gm in graph_modules:
        for node, info in _calls(gm):
            key = (info.namespace, info.name)
            rec = records.get(key)
            if rec is None:
                rec = records[key] = _OpCalls(info.namespace, info.name, info.function)
                new.append(key)
            ov = rec.overloads.setdefault(
                info.overload, {"calls": {"op": 0, "fwd": 0, "bwd": 0}, "sites": []}
            )
            if count:
                ov["calls"][info.role] += 1
            ov["sites"].append((node, info))
    return new


def _function(rec: _OpCalls):
    return rec.function or function_for_op(rec.namespace, rec.name)


def _definition(rec: _OpCalls) -> tuple:
    """(module, class, defined_in): where the op comes from."""
    fn = _function(rec)
    if fn is not None:
        return fn.cls.__module__, fn.cls.__qualname__, "python"
    for overload in rec.overloads:
        sov = S.stored_overload(rec.namespace, rec.name, overload)
        if sov is not None:
            return sov.op.module, sov.op.cls, sov.op.defined_in
    return None, None, "c++"


def _fingerprint(rec: _OpCalls):
    """Note [Function fingerprints]: of the Function that defines the op, or
    the one a loaded archive recorded for an op re-created from it."""
    fn = _function(rec)
    if fn is not None:
        return function_fingerprint(fn.cls)
    for overload in rec.overloads:
        sov = S.stored_overload(rec.namespace, rec.name, overload)
        if sov is not None:
            return sov.op.fingerprint
    return None


def _overload_record(rec: _OpCalls, overload: str) -> OverloadRecord:
    ns, name = rec.namespace, rec.name
    schema = schema_or_none(ns, name, overload)
    text = str(schema)
    ov = OverloadRecord(
        overload=overload,
        schema=text,
        fwd_schema=str(schema_or_none(ns, name + "_fwd", overload)),
        bwd_schema=str(schema_or_none(ns, name + "_bwd", overload)),
        arguments=text[text.index("(") + 1 : text.rindex(") ->")],
        n_out=len(schema.returns),
        returns_tuple=len(schema.returns) > 1,
        calls=Calls(**rec.overloads[overload]["calls"]),
    )
    fn = _function(rec)
    py_ov = fn.overloads.get(overload) if fn is not None else None
    sov = S.stored_overload(ns, name, overload)
    if py_ov is not None:
        ov.arguments = schema_arguments(py_ov.specs)
        ov.tokens = [s.token for s in py_ov.specs]
        ov.returns_tuple = py_ov.returns_tuple
        ov.n_out = py_ov.n_out
        ov.dirty = [tuple(p) for p in py_ov.dirty]
    elif sov is not None:
        ov.tokens = sov.record.tokens
        ov.returns_tuple = sov.record.returns_tuple
    return ov


def _warn_once(warned: set, key, message: str) -> None:
    if key not in warned:
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=5)


def save(ep, path, *, self_contained: bool = False) -> None:
    """``torch.export.save`` plus a manifest of the program's opaque ops.

    ``self_contained=True`` also stores each op's forward and backward traced to
    ATen (Note [Self-contained archives]), so a process without the defining
    module can load, run and train the program. Raises ArchiveError naming the
    op when an op cannot be traced (and then writes nothing); an inference
    program whose op's backward alone cannot be traced is saved with its
    forward only, with one warning per op (Note [Stored programs run in
    eager's state] in trace.py). Ops the program
    runs from stored programs (it was loaded from a self-contained archive)
    keep them in any case.
    """
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(
            f"torch_opaque.save expects a torch.export.ExportedProgram, got {type(ep).__name__}"
        )
    records: dict = {}
    worklist = _collect(_graph_modules(ep.graph_module), records, count=True)
    files: dict = {}
    stored_variants: dict = {}  # (ns, name, overload) -> list of VariantRecord
    counter = [0]
    warned: set = set()  # ops whose left-out backward save warned about
    while worklist:
        key = worklist.pop(0)
        rec = records[key]
        for overload in list(rec.overloads):
            sov = S.stored_overload(rec.namespace, rec.name, overload)
            if sov is None and not self_contained:
                continue
            fn = _function(rec)
            if fn is not None and fn.dirty:
                raise ArchiveError(
                    f"torch_opaque.save(self_contained=True): {rec.qualified_name} "
                    f"({fn.cls.__module__}.{fn.cls.__qualname__}) modifies its arguments in place "
                    f"(ctx.mark_dirty); self-contained archives cannot store in-place ops yet. "
                    f"Save without self_contained=True (the loading process imports the module)."
                )
            variants, programs = store_overload(rec, overload, files, counter, _function(rec), sov,
                                                warn=lambda m, key=key: _warn_once(warned, key, m))
            stored_variants[(rec.namespace, rec.name, overload)] = variants
            worklist += _collect([m for p in programs for m in _graph_modules(p)], records, count=False)
    ops = []
    for key in sorted(records):
        rec = records[key]
        module, cls, defined_in = _definition(rec)
        if module == "__main__" and not self_contained:
            warnings.warn(
                f"torch_opaque.save: {rec.qualified_name} is defined in __main__, which another "
                f"process cannot import; loading this archive elsewhere needs "
                f"torch_opaque.save(..., self_contained=True).",
                stacklevel=2,
            )
        overloads = []
        for overload in sorted(rec.overloads):
            ov = _overload_record(rec, overload)
            ov.variants = stored_variants.get((rec.namespace, rec.name, overload), [])
            overloads.append(ov)
        ops.append(OpEntry(rec.namespace, rec.name, module, cls, defined_in, overloads, _fingerprint(rec)))
    from .. import __version__  # (inside: the package defines it after importing archive/)

    manifest = Manifest(
        ops=ops,
        self_contained=bool(self_contained),
        torch_version=torch.__version__,
        torch_opaque_version=__version__,
    )
    extra = {MANIFEST: manifest.to_json()}
    extra.update(files)
    write_checked(ep, path, extra)  # Note [Saving reads back what it wrote]
