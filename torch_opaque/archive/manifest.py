"""The torch_opaque manifest (``extra/torch_opaque.json``) as typed records.

One reader, :func:`parse_manifest`, used by ``load`` and ``inspect``: it
validates every field and names the field that is wrong
(``ops[0].overloads[1].n_out``). Enum-like values are stored by name (the
kinds of saved tensors are ``"input"``, ``"output"``..., never the C++
integers); version 1 archives, which stored those integers, are read through a
fixed table.

Example::

    >>> from torch_opaque.archive.manifest import parse_manifest
    >>> m = parse_manifest(b'{"format": "torch_opaque.archive", "version": 2, "ops": []}', "m.pt2")
    >>> m.version, m.ops
    (2, [])
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

import torch

from .._impl.bridge import SavedKind
from ..errors import ArchiveError
from .values import DTYPES, decode_value
from .zipio import loads_json

# The alias annotation of an in-place op's argument: Tensor(a!)
_ALIAS_RE = re.compile(r"\([a-z]!\)")

MANIFEST = "torch_opaque.json"
PROGRAM_PREFIX = "torch_opaque.program."
FORMAT = "torch_opaque.archive"
VERSION = 2  # 2: saved-tensor kinds by name; 1: by C++ integer

IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PROGRAM_RE = re.compile(r"^torch_opaque\.program\.[0-9]{1,9}\.(fwd|bwd)$")

# What ctx.save_for_backward saved, by name in manifests (version 1 manifests
# stored the integer of the C++ enum torch_opaque::SavedKind); only this table
# maps the names to bridge.SavedKind.
SAVED_KIND_NAMES = {
    SavedKind.NONE: "none",
    SavedKind.INPUT: "input",
    SavedKind.INPUT_LIST_ITEM: "input_item",
    SavedKind.OUTPUT: "output",
    SavedKind.RESIDUAL: "residual",
}
SAVED_KINDS = tuple(SAVED_KIND_NAMES.values())
_SAVED_KIND_OF = {name: kind for kind, name in SAVED_KIND_NAMES.items()}
ARG_KINDS = ("none", "tensor", "tensors", "dyn", "const")
TOKENS = (
    "Tensor None bool int float str dtype device size Tensors tTensors bools tbools ints tints "
    "floats tfloats"
).split()


@dataclasses.dataclass
class TensorSig:
    dtype: str
    shape: list  # ints, None where the dimension is symbolic
    device: str

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "device": self.device}


@dataclasses.dataclass
class ArgRecord:
    """One argument of a stored kind of call."""

    kind: str  # ARG_KINDS
    tensor: Optional[TensorSig] = None  # kind "tensor"
    items: list = dataclasses.field(default_factory=list)  # kind "tensors": TensorSig
    value: Any = None  # kind "const": the encoded value (values.encode_value)

    def to_json(self) -> dict:
        d: dict = {"kind": self.kind}
        if self.kind == "tensor":
            d.update(self.tensor.to_json())
        elif self.kind == "tensors":
            d["items"] = [t.to_json() for t in self.items]
        elif self.kind == "const":
            d["value"] = self.value
        return d


@dataclasses.dataclass
class SavedRecord:
    """One tensor of ctx.save_for_backward: where it comes from."""

    kind: str  # SAVED_KINDS
    index: int = 0
    item: int = 0

    @property
    def code(self) -> SavedKind:
        return _SAVED_KIND_OF[self.kind]


@dataclasses.dataclass
class PartialBackward:
    """A stored backward for calls whose output gradients are not all defined
    (materialize-grads off: Note [Stored programs run in eager's state] in
    archive/trace.py)."""

    defined: list  # bool per output: whether its gradient is an input of the program
    grads: list  # argument positions the program returns gradients for
    bwd: str  # extra file name of the program

    def to_json(self) -> dict:
        return {"defined": list(self.defined), "grads": list(self.grads), "bwd": self.bwd}


@dataclasses.dataclass
class VariantRecord:
    """One kind of call of an overload, with its stored programs."""

    id: int
    args: list  # ArgRecord
    n_residuals: int
    n_state_ints: int
    saved: list  # SavedRecord
    non_differentiable: list  # bool per output
    grads: list  # argument positions the stored backward returns gradients for
    fwd: str  # extra file names of the programs
    bwd: Optional[str]  # None: the backward could not be traced (bwd_error says why)
    # the ctx state string the Function's forward recorded for this kind of call:
    # a training program's Name_bwd calls carry it (Note [Stored backward of
    # training programs] in stored.py); None in archives written before.
    state: Optional[str] = None
    materialize: bool = True  # ctx.set_materialize_grads as the forward set it
    partial: list = dataclasses.field(default_factory=list)  # PartialBackward
    bwd_error: Optional[str] = None  # why the backward was not stored

    def program_names(self) -> list:
        """The extra file names of every program of this kind of call."""
        names = [self.fwd] + ([self.bwd] if self.bwd is not None else [])
        return names + [p.bwd for p in self.partial]

    def saved_codes(self) -> list:
        """The (kind, index, item) integer triples the C++ forward record uses."""
        out = []
        for s in self.saved:
            out += [s.code, s.index, s.item]
        return out

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "args": [a.to_json() for a in self.args],
            "n_residuals": self.n_residuals,
            "n_state_ints": self.n_state_ints,
            "saved": [[s.kind, s.index, s.item] for s in self.saved],
            "non_differentiable": list(self.non_differentiable),
            "grads": list(self.grads),
            "fwd": self.fwd,
            **({"bwd": self.bwd} if self.bwd is not None else {}),
            **({"state": self.state} if self.state is not None else {}),
            **({"materialize": False} if not self.materialize else {}),
            **({"partial": [p.to_json() for p in self.partial]} if self.partial else {}),
            **({"bwd_error": self.bwd_error} if self.bwd_error is not None else {}),
        }


@dataclasses.dataclass
class Calls:
    op: int = 0
    fwd: int = 0
    bwd: int = 0


@dataclasses.dataclass
class OverloadRecord:
    overload: str
    schema: str
    arguments: str
    n_out: int
    returns_tuple: bool = False
    fwd_schema: Optional[str] = None
    bwd_schema: Optional[str] = None
    calls: Calls = dataclasses.field(default_factory=Calls)
    tokens: Optional[list] = None  # how the Function's overload was inferred
    variants: list = dataclasses.field(default_factory=list)  # VariantRecord
    # In-place ops: [output, argument] pairs (Note [In-place Functions]); the
    # schema annotates those arguments Tensor(a!) and omits those outputs.
    dirty: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        d = {
            "overload": self.overload,
            "schema": self.schema,
            "fwd_schema": self.fwd_schema,
            "bwd_schema": self.bwd_schema,
            "arguments": self.arguments,
            "n_out": self.n_out,
            "returns_tuple": self.returns_tuple,
            "calls": dataclasses.asdict(self.calls),
        }
        if self.tokens is not None:
            d["tokens"] = list(self.tokens)
        if self.dirty:
            d["dirty"] = [list(p) for p in self.dirty]
        if self.variants:
            d["variants"] = [v.to_json() for v in self.variants]
        return d


@dataclasses.dataclass
class OpEntry:
    namespace: str
    name: str
    module: Optional[str]  # the module defining the Function; None for C++ ops
    cls: Optional[str]  # its qualified name
    defined_in: str  # "python" or "c++"
    overloads: list  # OverloadRecord
    fingerprint: Optional[str] = None  # of the Function's definition (Note [Function fingerprints])

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}::{self.name}"

    def to_json(self) -> dict:
        return {
            "qualified_name": self.qualified_name,
            "namespace": self.namespace,
            "name": self.name,
            "module": self.module,
            "class": self.cls,
            "defined_in": self.defined_in,
            "overloads": [o.to_json() for o in self.overloads],
            **({"fingerprint": self.fingerprint} if self.fingerprint else {}),
        }


@dataclasses.dataclass
class Manifest:
    ops: list  # OpEntry
    self_contained: bool = False
    torch_version: str = "?"
    torch_opaque_version: str = "?"
    format: str = FORMAT
    version: int = VERSION

    def program_names(self) -> list:
        return [n for op in self.ops for ov in op.overloads for v in ov.variants for n in v.program_names()]

    def targets(self) -> set:
        """'torch.ops.ns.name.overload' of every overload the manifest describes,
        and of its forward and backward ops (which training programs call)."""
        return {
            f"torch.ops.{op.namespace}.{op.name}{part}.{ov.overload}"
            for op in self.ops
            for ov in op.overloads
            for part in ("", "_fwd", "_bwd")
        }

    def to_json(self) -> str:
        d = {
            "format": FORMAT,
            "version": VERSION,  # what this code writes, whatever version was read
            "torch_version": self.torch_version,
            "torch_opaque_version": self.torch_opaque_version,
            "self_contained": self.self_contained,
            "ops": [op.to_json() for op in self.ops],
        }
        return json.dumps(d, indent=1, sort_keys=True)


# ---- reading ---------------------------------------------------------------------------


class _Invalid(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(f"field {field}: {why}")


class _Obj:
    """A JSON object being read, with the path of its fields for errors."""

    def __init__(self, d, path: str):
        if not isinstance(d, dict):
            raise _Invalid(path or "(top level)", f"expected an object, got {_kind(d)}")
        self.d = d
        self.path = path

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key, check, *, default=_Invalid):
        if key not in self.d or (self.d[key] is None and default is not _Invalid):
            if default is _Invalid:
                raise _Invalid(self.field(key), "missing")
            return default
        return check(self.d[key], self.field(key))


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__ if not isinstance(v, (dict, list)) else (
        "an object" if isinstance(v, dict) else "a list"
    )


def _str(pattern: Optional[re.Pattern] = None, max_len: int = 4096):
    def check(v, f):
        if not isinstance(v, str) or len(v) > max_len:
            raise _Invalid(f, f"expected a string, got {_kind(v)}")
        if pattern is not None and not pattern.match(v):
            raise _Invalid(f, f"{v!r} is not valid")
        return v

    return check


def _int(lo: int = 0, hi: int = 1 << 31):
    def check(v, f):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
            raise _Invalid(f, f"expected an int in [{lo}, {hi}), got {v!r}")
        return v

    return check


def _bool(v, f):
    if not isinstance(v, bool):
        raise _Invalid(f, f"expected true or false, got {v!r}")
    return v


def _list(item, max_len: int = 1 << 20):
    def check(v, f):
        if not isinstance(v, list) or len(v) > max_len:
            raise _Invalid(f, f"expected a list, got {_kind(v)}")
        return [item(x, f"{f}[{i}]") for i, x in enumerate(v)]

    return check


def _one_of(choices):
    def check(v, f):
        if v not in choices:
            raise _Invalid(f, f"{v!r} is not one of {', '.join(map(repr, choices))}")
        return v

    return check


def _tensor_sig(v, f) -> TensorSig:
    o = _Obj(v, f)
    dim = _int(0, 1 << 40)

    def size(x, g):
        return None if x is None else dim(x, g)

    return TensorSig(
        dtype=o.get("dtype", _one_of(tuple(DTYPES))),
        shape=o.get("shape", _list(size, 64)),
        device=o.get("device", _str(re.compile(r"^[a-z]+(:[0-9]{1,4})?$"), 32)),
    )


def _arg(v, f) -> ArgRecord:
    o = _Obj(v, f)
    kind = o.get("kind", _one_of(ARG_KINDS))
    if kind == "tensor":
        return ArgRecord(kind, tensor=_tensor_sig(v, f))
    if kind == "tensors":
        return ArgRecord(kind, items=o.get("items", _list(_tensor_sig, 4096)))
    if kind == "const":
        if "value" not in o.d:
            raise _Invalid(o.field("value"), "missing")
        try:
            decode_value(o.d["value"])
        except (ValueError, RecursionError) as e:
            raise _Invalid(o.field("value"), str(e)) from None
        return ArgRecord(kind, value=o.d["value"])
    return ArgRecord(kind)


def _saved(version: int):
    def check(v, f) -> SavedRecord:
        if not isinstance(v, list) or len(v) != 3:
            raise _Invalid(f, f"expected [kind, index, item], got {v!r}")
        kind = v[0]
        if version == 1:
            kind = SAVED_KIND_NAMES[SavedKind(_int(0, len(SAVED_KINDS))(kind, f + "[0]"))]
        else:
            _one_of(SAVED_KINDS)(kind, f + "[0]")
        return SavedRecord(kind, _int(0, 1 << 20)(v[1], f + "[1]"), _int(0, 1 << 20)(v[2], f + "[2]"))

    return check


def _variant(version: int, position: int, n_out: int, n_args: int):
    def check(v, f) -> VariantRecord:
        o = _Obj(v, f)
        vid = o.get("id", _int(0, 1 << 20))
        if vid != position:
            raise _Invalid(o.field("id"), f"expected {position}, got {vid}")
        args = o.get("args", _list(_arg, 4096))
        if len(args) != n_args:
            raise _Invalid(o.field("args"), f"has {len(args)} entries for {n_args} arguments")
        n_res = o.get("n_residuals", _int(0, 1 << 20))
        if version == 1:
            flat = o.get("saved", _list(_int(0, 1 << 20)))
            if len(flat) % 3:
                raise _Invalid(o.field("saved"), "expected (kind, index, item) triples")
            saved = [_saved(1)(flat[k : k + 3], f"{o.field('saved')}[{k}]") for k in range(0, len(flat), 3)]
        else:
            saved = o.get("saved", _list(_saved(2)))
        for k, s in enumerate(saved):
            g = f"{o.field('saved')}[{k}]"
            if s.kind in ("input", "input_item") and s.index >= n_args:
                raise _Invalid(g, f"argument {s.index} of {n_args}")
            if s.kind == "input_item" and args[s.index].kind == "tensors" and s.item >= len(args[s.index].items):
                raise _Invalid(g, f"item {s.item} of {len(args[s.index].items)}")
            if s.kind == "output" and s.index >= n_out:
                raise _Invalid(g, f"output {s.index} of {n_out}")
            if s.kind == "residual" and s.index >= n_res:
                raise _Invalid(g, f"residual {s.index} of {n_res}")
        non_diff = o.get("non_differentiable", _list(_bool, n_out))
        grads = o.get("grads", _list(_int(0, max(n_args, 1)), n_args))
        bwd_error = o.get("bwd_error", _str(max_len=1 << 12), default=None)
        program = _str(_PROGRAM_RE, 64)
        return VariantRecord(
            id=vid,
            args=args,
            n_residuals=n_res,
            n_state_ints=o.get("n_state_ints", _int(0, 1 << 20)),
            saved=saved,
            non_differentiable=non_diff,
            grads=grads,
            fwd=o.get("fwd", _str(_PROGRAM_RE, 64)),
            # (no program either for a backward that returns no gradient: Note [A backward
            # with no gradients] in trace.py)
            bwd=o.get("bwd", program, **({"default": None} if bwd_error is not None or not grads else {})),
            state=o.get("state", _str(max_len=1 << 16), default=None),
            materialize=o.get("materialize", _bool, default=True),
            partial=_partials(o, n_out, n_args),
            bwd_error=bwd_error,
        )

    return check


def _partials(o: "_Obj", n_out: int, n_args: int) -> list:
    """A variant's PartialBackward records: one per pattern of defined output
    gradients, never the pattern where all are defined (that is ``bwd``)."""
    out, seen = [], set()
    for i, x in enumerate(o.get("partial", _list(lambda x, g: x, 1 << 8), default=[])):
        p = _Obj(x, f"{o.field('partial')}[{i}]")
        defined = p.get("defined", _list(_bool, n_out))
        if len(defined) != n_out or all(defined) or tuple(defined) in seen:
            raise _Invalid(p.field("defined"), f"expected a new pattern of {n_out} bools, not all true")
        seen.add(tuple(defined))
        out.append(PartialBackward(
            defined=defined,
            grads=p.get("grads", _list(_int(0, max(n_args, 1)), n_args)),
            bwd=p.get("bwd", _str(_PROGRAM_RE, 64)),
        ))
    return out


def _same_arguments(written: str, arguments: str) -> bool:
    """Whether two argument lists declare the same arguments. Compared parsed,
    not as text: a schema prints the default ``3.0`` as ``3.``."""
    if written == arguments:
        return True
    try:
        a = torch._C.parse_schema(f"check::a({written}) -> ()")
        b = torch._C.parse_schema(f"check::a({arguments}) -> ()")
    except RuntimeError:
        return False
    return str(a) == str(b)


def _overload(version: int, ns: str, name: str):
    def check(v, f) -> OverloadRecord:
        o = _Obj(v, f)
        overload = o.get("overload", _str(IDENT_RE, 256))
        schema_str = o.get("schema", _str(max_len=1 << 16))
        if not schema_str.isascii() or not schema_str.isprintable():
            raise _Invalid(o.field("schema"), "is not printable ASCII text (a schema is)")
        try:
            schema = torch._C.parse_schema(schema_str)
        except (RuntimeError, TypeError, ValueError) as e:
            raise _Invalid(o.field("schema"), f"does not parse ({(str(e).splitlines() or [''])[0]})") from None
        want = f"{ns}::{name}"
        if schema.name != want or (schema.overload_name or "default") != overload:
            raise _Invalid(o.field("schema"), f"names {schema.name}.{schema.overload_name or 'default'}, not {want}.{overload}")
        arguments = o.get("arguments", _str(max_len=1 << 16))
        written = schema_str[schema_str.index("(") + 1 : schema_str.rindex(") ->")]
        if not _same_arguments(_ALIAS_RE.sub("", written), arguments):
            raise _Invalid(o.field("arguments"), f"{arguments!r} are not the arguments of the schema")
        n_out = o.get("n_out", _int(1, 1 << 12))
        dirty = o.get("dirty", _list(_list(_int(0, 1 << 12), 2), 1 << 12), default=[])
        mutable = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None]
        if sorted(i for _, i in dirty) != mutable or any(len(p) != 2 or p[0] >= n_out for p in dirty):
            raise _Invalid(o.field("dirty"), f"{dirty} do not name the schema's Tensor(a!) arguments")
        if n_out != len(schema.returns) + len(dirty):
            raise _Invalid(o.field("n_out"), f"{n_out}, but the schema returns {len(schema.returns)}")
        calls = o.get("calls", lambda c, g: Calls(**{k: _Obj(c, g).get(k, _int(0, 1 << 40), default=0) for k in ("op", "fwd", "bwd")}), default=Calls())
        n_args = len(schema.arguments)
        return OverloadRecord(
            overload=overload,
            schema=schema_str,
            arguments=arguments,
            n_out=n_out,
            returns_tuple=o.get("returns_tuple", _bool, default=n_out > 1),
            fwd_schema=o.get("fwd_schema", _str(max_len=1 << 16), default=None),
            bwd_schema=o.get("bwd_schema", _str(max_len=1 << 16), default=None),
            calls=calls,
            tokens=o.get("tokens", _list(_one_of(TOKENS), 4096), default=None),
            dirty=[tuple(p) for p in dirty],
            variants=[
                _variant(version, i, n_out, n_args)(x, f"{o.field('variants')}[{i}]")
                for i, x in enumerate(o.get("variants", _list(lambda x, g: x, 4096), default=[]))
            ],
        )

    return check


def _op(version: int):
    def check(v, f) -> OpEntry:
        o = _Obj(v, f)
        ns = o.get("namespace", _str(IDENT_RE, 256))
        name = o.get("name", _str(IDENT_RE, 256))
        cls = o.get("class", _str(re.compile(r"^[A-Za-z_<>.0-9]+$"), 1024), default=None)
        ovs = o.get("overloads", _list(_overload(version, ns, name), 4096))
        if not ovs:
            raise _Invalid(o.field("overloads"), "is empty")
        names = [x.overload for x in ovs]
        if len(set(names)) != len(names):
            raise _Invalid(o.field("overloads"), "names an overload twice")
        return OpEntry(
            namespace=ns,
            name=name,
            module=o.get("module", _str(MODULE_RE, 1024), default=None),
            cls=cls,
            defined_in=o.get("defined_in", _one_of(("python", "c++")), default="python"),
            overloads=ovs,
            fingerprint=o.get("fingerprint", _str(re.compile(r"^[0-9a-f]{32}$"), 32), default=None),
        )

    return check


def bad_manifest(description: str, why: str) -> ArchiveError:
    return ArchiveError(
        f"torch_opaque: the manifest ({MANIFEST}) in {description} is corrupted or invalid: "
        f"{why}."
    )


def parse_manifest(raw: bytes, description: str) -> Manifest:
    """The typed manifest, every field checked; ArchiveError naming the field."""
    try:
        d = loads_json(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, limits
        why = "it is nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise bad_manifest(description, f"{type(e).__name__}: {why}") from e
    try:
        o = _Obj(d, "")
        if d.get("format") != FORMAT:
            raise bad_manifest(description, f"it does not say format '{FORMAT}'")
        version = o.get("version", _int(1, 1 << 16))
        if version > VERSION:
            raise bad_manifest(
                description,
                f"version {version} is not one this torch_opaque reads (it reads versions "
                f"{', '.join(map(str, range(1, VERSION + 1)))}); upgrade torch_opaque",
            )
        ops = o.get("ops", _list(_op(version), 1 << 16))
        seen = set()
        for i, op in enumerate(ops):
            if (op.namespace, op.name) in seen:
                raise _Invalid(f"ops[{i}]", f"{op.qualified_name} is listed twice")
            seen.add((op.namespace, op.name))
        m = Manifest(
            ops=ops,
            self_contained=o.get("self_contained", _bool, default=False),
            torch_version=o.get("torch_version", _str(max_len=256), default="?"),
            torch_opaque_version=o.get("torch_opaque_version", _str(max_len=256), default="?"),
            version=version,
        )
    except _Invalid as e:
        raise bad_manifest(description, str(e)) from None
    names = m.program_names()
    if len(set(names)) != len(names):
        raise bad_manifest(description, "two variants name the same stored program")
    return m
