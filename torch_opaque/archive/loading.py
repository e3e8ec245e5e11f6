"""``torch_opaque.load``: an exported program whose opaque ops are re-registered
first, reading the archive as data (Note [Reading pt2 without unpickling]),
importing only the modules the caller allows, never running code from the file.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Iterable, Optional

import torch

from ..errors import ArchiveError, OpNotAllowedError
from ..ops import is_opaque_triple, schema_or_none
from .._impl import autocast_variant
from .._impl import function as F
from .._impl.schema import schema_arguments, specs_from_values
from . import stored as S
from .manifest import MODULE_RE, Manifest, OpEntry, OverloadRecord, bad_manifest
from .call_graph import check_call_graph
from .fingerprint import FUNCTION_CHANGED, definition_to_run
from .own_ops import fake_outputs
from .program import check_model_json, deserialize, read_tensors
from .reader import ArchiveContents, read_contents
from .zipio import ArchiveLimits, ZipReader, describe


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


def _claim_text(field: str, value) -> str:
    if field == "returns_tuple":
        return str(bool(value)).lower()
    if field == "dirty":
        return str([list(p) for p in value])
    return str(value)


def _refuse_claim(fn, ov: OverloadRecord, field: str, claimed, actual, source: str,
                  description: str) -> ArchiveError:
    """Note [Archive claims] (_impl/opaque_function.py): the archive says something
    about the outputs of an op that a Function of this process defines, and
    the Function says otherwise."""
    cls = fn.cls
    return ArchiveError(
        f"torch_opaque.load: {description} says {fn.namespace}::{fn.name}.{ov.overload} has "
        f"{field}={_claim_text(field, claimed)}, but this process's "
        f"{cls.__module__}.{cls.__qualname__}, which defines that op, gives "
        f"{field}={_claim_text(field, actual)} ({source}). The archive was not written by "
        f"torch_opaque.save for this Function (the Function changed since, or the file was "
        f"edited), so it is refused: load an archive saved from this Function, or export "
        f"and save the program again."
    )


def _check_claims(fn, ov: OverloadRecord, description: str, probe=None) -> None:
    """Refuses an archive whose outputs of ``ov`` (n_out, returns_tuple, dirty)
    differ from what this process's Function is known to give: an overload it
    already has, its return annotation, or else (``probe``: the specs and
    example values of the overload) its forward run on fake tensors (Note
    [The caller's own ops])."""
    have = fn.overloads.get(ov.overload)
    if have is not None:
        source = (
            f"as loading {have.claimed_by} defined it, not yet confirmed by a call"
            if have.claimed_by is not None
            else "the op as this process defined it"
        )
        for field, actual, claimed in (
            ("n_out", have.n_out, ov.n_out),
            ("returns_tuple", bool(have.returns_tuple), bool(ov.returns_tuple)),
            ("dirty", tuple(map(tuple, have.dirty)), tuple(map(tuple, ov.dirty))),
        ):
            if actual != claimed:
                raise _refuse_claim(fn, ov, field, claimed, actual, source, description)
        return
    if fn.returns_hint is not None:
        n_out, returns_tuple = fn.returns_hint
        source = "its forward's return annotation"
        if n_out != ov.n_out:
            raise _refuse_claim(fn, ov, "n_out", ov.n_out, n_out, source, description)
        if bool(returns_tuple) != bool(ov.returns_tuple):
            raise _refuse_claim(
                fn, ov, "returns_tuple", ov.returns_tuple, returns_tuple, source, description
            )
    learnt = None
    if probe is not None and (fn.returns_hint is None or (fn.dirty and fn.dirty_pairs is None)):
        learnt = fake_outputs(fn, *probe)
    if learnt is not None:
        source = "its forward, run on fake tensors while loading"
        n_out, returns_tuple = learnt
        for field, actual, claimed in (
            ("n_out", n_out, ov.n_out), ("returns_tuple", bool(returns_tuple), bool(ov.returns_tuple))
        ):
            if actual != claimed:
                raise _refuse_claim(fn, ov, field, claimed, actual, source, description)
    if fn.dirty and fn.dirty_pairs is not None and tuple(fn.dirty_pairs) != tuple(map(tuple, ov.dirty)):
        raise _refuse_claim(
            fn, ov, "dirty", ov.dirty, fn.dirty_pairs, "what its forward marked dirty", description
        )


def _define_python_overload(fn, ov: OverloadRecord, description: str) -> None:
    """Defines a recorded overload of a registered Function without calling it
    (OpaqueFunction.overload_for would probe the forward with example values).
    The arguments must be the Function's own; what the manifest says of the
    outputs is checked against what the Function is known to give, and is
    otherwise a claim that the Function's first call of that overload confirms
    before any call uses it (Note [Archive claims] in _impl/opaque_function.py)."""
    found = _python_overload(fn, ov, description)
    if found is not None:
        name, specs = found
        fn.define_overload(
            name, specs, ov.n_out, ov.returns_tuple, dirty=tuple(map(tuple, ov.dirty)),
            claimed_by=description,
        )


def _python_overload(fn, ov: OverloadRecord, description: str) -> Optional[tuple]:
    """(overload name, specs) to define ``ov`` of a registered Function with, or
    None when the Function has it; ArchiveError when the archive does not
    match the Function. Defines nothing."""
    overload = ov.overload
    qual = f"{fn.namespace}::{fn.name}.{overload}"
    if overload in fn.overloads:
        have = str(schema_or_none(fn.namespace, fn.name, overload))
        if have != ov.schema:
            raise ArchiveError(
                f"torch_opaque.load: {description} calls {ov.schema}, but this process's "
                f"{fn.cls.__module__}.{fn.cls.__qualname__} defines {have}; the archive was not "
                f"written by torch_opaque.save for this Function: load one that was."
            )
        _check_claims(fn, ov, description)
        return None
    values = None
    if fn.hint_specs is not None and overload == "default":
        specs, name = fn.hint_specs, ""  # (a call whose values the hints do not
        # carry has an overload from its values: Note [Hints are advice])
    else:
        tokens = ov.tokens
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
                f"({ov.schema})."
            )
        specs = specs_from_values(names, values, fn.defaults, fn.display_name)
        name = "_".join(s.token for s in specs) or "noargs"
    if (name or "default") != overload or schema_arguments(specs) != ov.arguments:
        raise ArchiveError(
            f"torch_opaque.load: {fn.cls.__module__}.{fn.cls.__qualname__} now defines "
            f"{fn.namespace}::{fn.name}.{name or 'default'}"
            f"({schema_arguments(specs)}), but {description} was saved with "
            f"{ov.schema}; the Function changed since the archive was written."
        )
    if fn.dirty != bool(ov.dirty) or any(not specs[i].is_tensor for _, i in ov.dirty):
        raise ArchiveError(
            f"torch_opaque.load: {fn.cls.__module__}.{fn.cls.__qualname__} now modifies "
            f"{'arguments' if fn.dirty else 'no argument'} in place, but {description} was saved "
            f"with {ov.schema}; the Function changed since the archive was written."
        )
    _check_claims(fn, ov, description, None if values is None else (specs, values))
    return name, specs


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


class _RunStored(Exception):
    """The imported module's Function is not the archive's, and the caller
    chose its stored programs (Note [Function fingerprints])."""


def _identity(op_entry: OpEntry, cls, missing: list, description: str, function_changed: str) -> None:
    if definition_to_run(
        op_entry, cls, description, function_changed, all(ov.variants for ov in missing)
    ) == "stored":
        raise _RunStored()


def _register_from_module(op_entry: OpEntry, missing: list, description: str,
                          function_changed: str = "error") -> None:
    ns, name, module_name = op_entry.namespace, op_entry.name, op_entry.module
    module = importlib.import_module(module_name)
    fn = F.function_for_op(ns, name)
    base_qualname, _, last = (op_entry.cls or "").rpartition(".")
    if fn is None and last == autocast_variant.QUALNAME_PART:
        fn = _autocast_variant(module, base_qualname, op_entry, description)
    if fn is None:
        cls = _resolve_class(module, op_entry.cls)
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise ArchiveError(
                f"torch_opaque.load: {description} needs {ns}::{name}, defined by class "
                f"{op_entry.cls} in module {module_name}; the module was imported but "
                f"has no such autograd.Function."
            )
        _identity(op_entry, cls, missing, description, function_changed)
        existing = F.lookup(cls)
        if existing is not None and (existing.namespace, existing.name) != (ns, name):
            raise ArchiveError(
                f"torch_opaque.load: {module_name}.{op_entry.cls} is now the op "
                f"{existing.namespace}::{existing.name}, but {description} calls it {ns}::{name}."
            )
        F.wrap(cls, name=name, namespace=ns, _patch_apply=False)
        fn = F.function_for_op(ns, name)
    else:  # (the module registered it as it was imported)
        _identity(op_entry, fn.cls, missing, description, function_changed)
    for ov in missing:  # every overload checked before any is defined
        _python_overload(fn, ov, description)
    for ov in missing:
        _define_python_overload(fn, ov, description)


def _registered_variant(op_entry: OpEntry):
    """The autocast variant the archive calls, when its base class is an op of this
    process already (Note [Autocast in the call]); None otherwise."""
    suffix = autocast_variant.SUFFIX
    if not ((op_entry.cls or "").endswith("." + autocast_variant.QUALNAME_PART)
            and op_entry.name.endswith(suffix)):
        return None
    base = F.function_for_op(op_entry.namespace, op_entry.name[: -len(suffix)])
    if base is None:
        return None
    return autocast_variant.variant_from_archive(base, op_entry.namespace, op_entry.name)


def _autocast_variant(module, base_qualname: str, op_entry: OpEntry, description: str):
    """Note [Autocast in the call]: the autocast variant of a class the module
    defines, with the op name the archive calls."""
    ns, name = op_entry.namespace, op_entry.name
    base = _resolve_class(module, base_qualname)
    where = f"{op_entry.module}.{base_qualname}"
    if not (isinstance(base, type) and issubclass(base, torch.autograd.Function)):
        raise ArchiveError(
            f"torch_opaque.load: {description} needs {ns}::{name}, the autocast variant of class "
            f"{where}; the module was imported but has no such autograd.Function."
        )
    base_fn = F.lookup(base)
    if base_fn is None and name.endswith(autocast_variant.SUFFIX):
        F.wrap(base, name=name[: -len(autocast_variant.SUFFIX)], namespace=ns, _patch_apply=False)
        base_fn = F.lookup(base)
    variant = autocast_variant.variant_from_archive(base_fn, ns, name) if base_fn else None
    if variant is None:
        got = f"{base_fn.namespace}::{base_fn.name}" if base_fn else "not an op"
        raise ArchiveError(
            f"torch_opaque.load: {description} calls {ns}::{name}, the autocast variant of "
            f"{where}, but that class is {got} in this process, whose variant has another name. "
            f"Wrap {base_qualname} with the name it had when the program was saved "
            f"({name[: -len(autocast_variant.SUFFIX)]!r})."
        )
    return variant


def _missing_message(description: str, path_repr: str, problems: list, allow: list) -> str:
    lines = [
        f"torch_opaque.load: {description} calls opaque ops that are not registered in this "
        f"process, and loading may not import the modules that define them:"
    ]
    modules = []
    for op_entry, why in problems:
        mod = op_entry.module
        cls = op_entry.cls
        where = f"class {cls} in module {mod}" if mod else "C++ (no Python module)"
        lines.append(f"  - {op_entry.qualified_name}: defined by {where}; {why}")
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


def _plan(manifest: Manifest, path, description: str, allow: list, allow_all: bool,
          function_changed: str = "error") -> list:
    """(action, op entry, missing overloads) for every op the process lacks,
    decided before anything is imported; OpNotAllowedError lists the ops no
    allowed module or stored program can provide. An op whose Function the
    process has with another definition than the archive's is refused, or run
    as ``function_changed`` says (Note [Function fingerprints])."""
    plan = []
    problems = []
    for op in manifest.ops:
        ns, name = op.namespace, op.name
        own = F.function_for_op(ns, name) or _registered_variant(op)
        if own is not None and definition_to_run(
            op, own.cls, description, function_changed, all(ov.variants for ov in op.overloads)
        ) == "stored":
            plan.append(("stored", op, list(op.overloads)))
            continue
        missing = []
        for ov in op.overloads:
            if is_opaque_triple(ns, name, ov.overload):
                have = str(schema_or_none(ns, name, ov.overload))
                if have != ov.schema:
                    raise ArchiveError(
                        f"torch_opaque.load: {description} calls {ov.schema}, but this "
                        f"process already defines {have}."
                    )
                fn = F.function_for_op(ns, name)
                if fn is not None and ov.overload in fn.overloads:
                    _check_claims(fn, ov, description)
            else:
                missing.append(ov)
        # overloads that were themselves re-created from stored programs
        aliases = [ov for ov in missing if S.is_stored_name(ov.overload)]
        missing = [ov for ov in missing if not S.is_stored_name(ov.overload)]
        for ov in aliases:
            if not ov.variants:
                problems.append((op, f"{ov.overload} was re-created from stored programs, which "
                                     f"the archive does not hold"))
        if aliases:
            plan.append(("stored", op, aliases))
        if not missing:
            continue
        stored = all(ov.variants for ov in missing)
        fn = F.function_for_op(ns, name) or _registered_variant(op)
        if fn is not None:
            for ov in missing:  # refused before anything is imported or defined
                _python_overload(fn, ov, description)
            plan.append(("registered", op, missing))
        elif _allowed(op.module, allow, allow_all):
            plan.append(("import", op, missing))
        elif stored:
            plan.append(("stored", op, missing))
        elif op.module is None:
            problems.append((op, "load the library that defines it before loading"))
        elif op.module == "__main__":
            problems.append(
                (
                    op,
                    "it was defined in the saving script (__main__), which cannot be imported; "
                    "save with torch_opaque.save(ep, path, self_contained=True) or define it in "
                    "a module",
                )
            )
        elif allow or allow_all:
            problems.append((op, f"module {op.module} is not in allow={list(allow)!r}"))
        else:
            problems.append((op, "no module may be imported (allow is empty)"))
    if problems:
        path_repr = repr(description) if isinstance(path, (str, os.PathLike)) else "f"
        raise OpNotAllowedError(_missing_message(description, path_repr, problems, allow))
    return plan


def _read_programs(z: ZipReader, contents: ArchiveContents, plan: list) -> dict:
    """extra file name -> stored program text, for every variant the plan may need;
    at most ``ArchiveLimits.programs`` of them (Note [Stored call graph])."""
    out = {}
    needed = {n for _a, _o, missing in plan for ov in missing for v in ov.variants for n in (v.fwd, v.bwd)}
    if len(needed) > z.limits.programs:
        raise ArchiveError(
            f"torch_opaque.load: {z.description} holds {len(needed)} stored programs for the ops "
            f"it re-creates, more than the programs limit of {z.limits.programs} (each costs "
            f"tens of milliseconds of CPU to read). Raise it with "
            f"limits=ArchiveLimits(programs=...) if you trust the file."
        )
    for _action, _op, missing in plan:
        for ov in missing:
            for v in ov.variants:
                for name in v.program_names():
                    entry = contents.extra.get(name)
                    if entry is None:
                        raise ArchiveError(
                            f"torch_opaque: {z.description} lacks the stored program '{name}' "
                            f"that its manifest names; the archive is truncated or corrupted."
                        )
                    out[name] = z.text(entry, "program")
    return out


def _prepare_ops(plan: list, programs: dict, description: str, limits: ArchiveLimits,
                 function_changed: str = "error") -> dict:
    """Makes every planned op available; returns the renames of serialized call
    targets to stored overloads (Note [Stored ops beside real ones])."""
    rename: dict = {}
    created = []
    for action, op, missing in plan:
        if action == "registered":
            fn = F.function_for_op(op.namespace, op.name)
            for ov in missing:
                _define_python_overload(fn, ov, description)
            continue
        if action == "import":
            try:
                _register_from_module(op, missing, description, function_changed)
                continue
            except _RunStored:
                pass
            except ImportError as e:
                if not all(ov.variants for ov in missing):
                    raise ArchiveError(
                        f"torch_opaque.load: {description} needs {op.qualified_name} from module "
                        f"{op.module}, which cannot be imported ({type(e).__name__}: {e})."
                    ) from e
                warnings.warn(
                    f"torch_opaque.load: cannot import {op.module} ({e}); {op.qualified_name} "
                    f"runs the programs stored in {description} instead.",
                    stacklevel=3,
                )
        for ov in missing:
            try:
                registered = S.stored_name(ov, programs)
                sov, new = S.define_stored(op, ov, programs, registered)
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
                raise bad_manifest(
                    description,
                    f"the stored programs of {op.qualified_name}.{ov.overload} are described "
                    f"wrongly ({type(e).__name__}: {e})",
                ) from e
            rename.update(S.renames(op.namespace, op.name, ov.overload, registered))
            if new:
                created.append(sov)
    # Deserialize the stored programs once every op (they may call each other) exists.
    for sov in created:
        sov.deserialize(description, limits, rename)
    _check_stored_calls(created, description, limits)
    return rename


def _check_stored_calls(created: list, description: str, limits: ArchiveLimits) -> None:
    """Note [Stored call graph] (call_graph.py): a refused archive leaves the
    overloads it defined without programs, and not ready."""
    try:
        check_call_graph(created, S.all_stored(), description, limits.call_depth)
    except ArchiveError as e:
        for sov in created:
            sov.refuse(str(e))
        raise


def _check_plain(contents: ArchiveContents) -> None:
    unknown = []
    for target in sorted(contents.custom_targets()):
        _, _, ns, name, overload = target.split(".")
        if schema_or_none(ns, name, overload) is None:
            unknown.append(f"{ns}::{name}.{overload}")
    if unknown:
        raise ArchiveError(
            f"torch_opaque.load: {contents.path} was written by torch.export.save (it has no "
            f"torch_opaque manifest) and calls operators that are not registered in this "
            f"process: {', '.join(unknown)}. It does not say which module defines them, so "
            f"nothing is imported: import the modules that define them first (and save with "
            f"torch_opaque.save next time)."
        )


def load(
    path,
    *,
    allow: Iterable[str] = (),
    allow_all: bool = False,
    limits: Optional[ArchiveLimits] = None,
    function_changed: str = "error",
):
    """The exported program of a .pt2 archive, its opaque ops re-registered first.

    Loading runs nothing from the file (Note [Reading pt2 without unpickling]):
    no pickle, no expression evaluation, no call that is not an operator. It
    may import modules, but only those the caller names:

    ``allow``: modules (or dotted prefixes: ``"mypkg"`` allows ``"mypkg.ops"``)
    that may be imported to define missing ops; ``allow_all=True`` allows any.
    Nothing is imported otherwise: a missing op raises OpNotAllowedError (before
    anything is imported) unless the archive is self-contained, in which case
    the op is re-created from its stored programs (Note [Stored ops beside real
    ones]). ``limits``: the largest sizes read (:class:`ArchiveLimits`, Note
    [Size limits]). Corrupted, truncated, oversized or crafted files raise
    ArchiveError naming the file, the part and the cause.

    ``function_changed``: what runs when a Function this process has (or an
    allowed module defines) is not the definition the archive was saved with
    (Note [Function fingerprints] in fingerprint.py): ``"error"`` (default)
    refuses the archive, ``"run_process"`` runs this process's definition,
    ``"run_stored"`` the programs a self-contained archive stored.
    """
    if function_changed not in FUNCTION_CHANGED:
        raise ValueError(
            f"torch_opaque.load: function_changed must be one of {', '.join(map(repr, FUNCTION_CHANGED))}, "
            f"got {function_changed!r}"
        )
    if isinstance(allow, str):
        allow = [allow]
    allow = list(allow)
    for a in allow:
        if not isinstance(a, str) or not MODULE_RE.match(
            a[:-2] if a.endswith(".*") else a.rstrip(".")
        ):
            raise ValueError(f"torch_opaque.load: allow entries are module names, got {a!r}")
    if limits is None:
        limits = ArchiveLimits()
    elif not isinstance(limits, ArchiveLimits):
        raise TypeError(f"torch_opaque.load: limits must be an ArchiveLimits, got {type(limits).__name__}")
    description = describe(path)
    with ZipReader(path, description, limits) as z:
        contents = read_contents(z)
        if "model" not in contents.models:
            raise ArchiveError(
                f"torch_opaque: {description} holds the programs {sorted(contents.models)}, "
                f"not 'model' (the one torch.export.save writes)."
            )
        where = "models/model.json"
        model = contents.models["model"]
        # Everything is read and checked before any module is imported.
        if contents.manifest is None:
            _check_plain(contents)
        described = contents.manifest.targets() if contents.manifest is not None else ()
        check_model_json(model, where, description, {}, limits, described)
        tensors = read_tensors(z, contents.root, "model", description)
        if contents.manifest is None:
            plan, programs = [], {}
        else:
            plan = _plan(contents.manifest, path, description, allow, allow_all, function_changed)
            programs = _read_programs(z, contents, plan)
    rename = _prepare_ops(plan, programs, description, limits, function_changed)
    return deserialize(model, tensors, description, where, rename, limits)
