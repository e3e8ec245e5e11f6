"""Reading the exported programs of a .pt2 archive as data: no pickle is run.

Note [Reading pt2 without unpickling]
``torch.export.load`` unpickles parts of an archive: the sample inputs, weights
and constants marked ``use_pickle`` (falling back to ``weights_only=False``),
custom objects (TorchScript pickles) and opaque objects (``pickle.loads``).
Its graph deserializer also hands expression strings to ``sympy.sympify``
(which evaluates them) and resolves call targets by walking ``getattr`` from
the ``torch``, ``math`` and ``operator`` modules. torch_opaque therefore reads
the archive itself, following the layout written by torch/export/pt2_archive:

* ``models/<name>.json`` is parsed as JSON; before torch's deserializer sees
  it, every call target must be an operator (``torch.ops.ns.name.overload``)
  or one of the symbolic-size operators torch serializes, and every symbolic
  expression must consist of numbers, operators, size symbols and the known
  sympy functions (so evaluating it can reach nothing else), and every guard
  (``guards_code``, which ``ExportedProgram.module()`` exec()s) must be a
  comparison of input sizes (``L['x'].size()[0] > 3``). After
  deserialization every call is checked again to be an OpOverload, a
  HigherOrderOperator or a symbolic-size operator;
* weights and tensor constants are rebuilt from their raw bytes and the tensor
  metadata of ``data/*/<name>_*_config.json``; a payload torch pickled (tensor
  subclasses) is read with ``torch.load(weights_only=True)`` and never with a
  fallback; custom and opaque objects, legacy pickled weight files, and
  anything that is not a tensor are refused with an ArchiveError naming the
  part;
* ``data/sample_inputs`` is never read: running a program does not need it
  (the loaded program's ``example_inputs`` is None).

Every entry is read through :class:`~torch_opaque.archive.zipio.ZipReader`
within its size limit (Note [Size limits]).

Example::

    >>> from torch_opaque.archive.program import check_guard, check_sym_expr
    >>> check_sym_expr("Mul(Integer(2), Symbol('s0', positive=True, integer=True))") is None
    True
    >>> check_sym_expr("__import__('os').system('ls')")
    "unknown name '__import__'"
    >>> check_guard("L['x'].size()[0] > 3") is None
    True
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import operator
import pickle
import re
from typing import Optional

import functools

import torch

from ..errors import ArchiveError
from .zipio import ZipReader

MODELS_DIR = "models/"
WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
EXTRA_DIR = "extra/"
_OP_TARGET_RE = re.compile(r"^torch\.ops\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_PAYLOAD_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")


def _serde():
    """torch's export serialization (imported on first use: it imports Dynamo,
    which ``import torch_opaque`` must not)."""
    from torch._export.serde import schema, serialize

    return schema, serialize


@functools.lru_cache(maxsize=None)
def sym_targets() -> dict:
    """Serialized name -> function, for the symbolic-size operators torch writes."""
    _, serialize = _serde()
    out = {f"{op.__module__}.{op.__name__}": op for op in serialize._SYM_OPS}
    out["_operator.getitem"] = operator.getitem
    return out

# ---- symbolic expressions ------------------------------------------------------------------

_SYMPY_NAMES = {
    # torch.utils._sympy.functions (the deserializer's own table)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv",
    "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    # sympy names str(expr) prints
    "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan",
    "StrictGreaterThan", "LessThan", "GreaterThan", "Equality", "Unequality", "And", "Or",
    "Not", "Xor", "oo", "zoo", "nan", "True", "False", "Integer", "Rational", "Float", "sqrt",
    "floor", "ceiling", "Piecewise", "ExprCondPair", "ITE", "Pow", "Mul", "Add", "S", "E",
    "pi", "I", "Symbol", "true", "false", "Half", "One", "NegativeOne", "Zero", "Infinity",
    "NegativeInfinity",
    # assumptions and options srepr prints as keywords: Symbol('s0', positive=True)
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
    "commutative", "nonzero", "zero", "even", "odd", "rational", "extended_real", "precision",
}  # fmt: skip
_SYMBOL_RE = re.compile(r"^[a-z]{1,8}[0-9]{1,9}$")  # s0, u3, zuf0, ps1...
# srepr output: Mul(Integer(2), Symbol('s0', positive=True, integer=True)); strings
# only name symbols or spell numbers.
_EXPR_TOKEN = re.compile(
    r"\s+|[A-Za-z_][A-Za-z0-9_]*|[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|'[A-Za-z0-9_.+-]{1,64}'"
    r"|\*\*|//|==|!=|<=|>=|[-+*/%(),<>&|~^=]"
)


def check_sym_expr(expr: str) -> Optional[str]:
    """Why a serialized symbolic expression is not plain arithmetic, or None."""
    if len(expr) > 100_000:
        return "it is too long"
    pos = 0
    while pos < len(expr):
        m = _EXPR_TOKEN.match(expr, pos)
        if m is None:
            return f"unexpected {expr[pos:pos + 10]!r}"
        tok = m.group(0)
        if tok[0].isalpha() or tok[0] == "_":
            if tok not in _SYMPY_NAMES and not _SYMBOL_RE.match(tok):
                return f"unknown name {tok!r}"
        pos = m.end()
    return None


# ---- guards ----------------------------------------------------------------------------------

# ExportedProgram.module() turns the program's guards_code into Python source
# and exec()s it; each guard must be a comparison of input sizes.
_GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_FUNCS = {"Max", "Min", "abs", "int", "float", "bool"}
_GUARD_NODES = (
    ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Constant, ast.Subscript,
    ast.Call, ast.Name, ast.Attribute, ast.Load, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.Eq, ast.NotEq,
    ast.Lt, ast.LtE, ast.Gt, ast.GtE,
)  # fmt: skip


def check_guard(code) -> Optional[str]:
    """Why a serialized guard is not a plain check of input sizes, or None."""
    if not isinstance(code, str) or len(code) > 10_000:
        return "it is not a short string"
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"it does not parse ({type(e).__name__})"
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return f"{type(node).__name__} is not allowed"
        if isinstance(node, ast.Name) and node.id != "L" and node.id not in _GUARD_FUNCS:
            return f"unknown name {node.id!r}"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str)):
            return f"constant {node.value!r} is not allowed"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", node.value):
            return f"key {node.value!r} is not an input name"
        if isinstance(node, ast.Attribute) and node.attr not in _GUARD_METHODS:
            return f"attribute {node.attr!r} is not allowed"
        if isinstance(node, ast.Call):
            f = node.func
            if node.keywords or not (
                (isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS and len(node.args) <= 1)
                or (isinstance(f, ast.Name) and f.id in _GUARD_FUNCS)
            ):
                return "a call that is not a size query"
    return None


# ---- the model JSON ------------------------------------------------------------------------


def check_model_json(model, where: str, description: str, rename: dict) -> None:
    """Refuses call targets and expressions that are not plain operators or
    arithmetic; renames targets (Note [Stored ops beside real ones]) in place."""
    guards = model.get("guards_code") if isinstance(model, dict) else None
    for g in guards or []:
        why = check_guard(g)
        if why is not None:
            raise ArchiveError(
                f"torch_opaque.load: {where} in {description} has the guard {str(g)[:80]!r}, "
                f"which is not a plain check of input sizes ({why}); torch would run it as "
                f"Python code. The archive was crafted; it is not loaded."
            )
    stack = [model]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if "target" in o and "inputs" in o and "outputs" in o:
                t = o["target"]
                if not isinstance(t, str) or not (_OP_TARGET_RE.match(t) or t in sym_targets()):
                    raise ArchiveError(
                        f"torch_opaque.load: {where} in {description} calls {t!r}, which is "
                        f"not an operator; only torch.ops.<namespace>.<op>.<overload> and "
                        f"symbolic-size arithmetic may be called. The archive was crafted; it "
                        f"is not loaded."
                    )
                if t in rename:
                    o["target"] = rename[t]
            e = o.get("expr_str")
            if e is not None:
                why = check_sym_expr(e) if isinstance(e, str) else "it is not a string"
                if why is not None:
                    raise ArchiveError(
                        f"torch_opaque.load: {where} in {description} has the symbolic "
                        f"expression {str(e)[:80]!r}, which is not plain arithmetic ({why}). "
                        f"The archive was crafted; it is not loaded."
                    )
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def parse_json(raw: str, where: str, description: str):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ArchiveError(
            f"torch_opaque: the serialized graph '{where}' in {description} is corrupted "
            f"({type(e).__name__}: {e})."
        ) from e


def check_graph(ep, where: str, description: str) -> None:
    """Every call of the deserialized program is an operator (see the Note)."""
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op in ("call_module", "call_method"):
                bad = node.target
            elif node.op == "call_function" and not (
                isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
                or node.target in sym_targets().values()
            ):
                bad = node.target
            else:
                continue
            raise ArchiveError(
                f"torch_opaque.load: {where} in {description} calls {bad!r}, which is not a "
                f"registered operator (node '{node.name}'). Load the library that defines it "
                f"first; a crafted archive is not loaded."
            )


# ---- tensors -----------------------------------------------------------------------------


def _check_payload_name(name, where: str, description: str) -> str:
    if not isinstance(name, str) or not _PAYLOAD_NAME_RE.match(name) or name in (".", ".."):
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} names the payload {name!r}, "
            f"which is not a file name; the archive was crafted or corrupted."
        )
    return name


def _unpickle_tensor(z: ZipReader, entry: str, what: str, description: str) -> torch.Tensor:
    """A tensor torch pickled (a tensor subclass), read with weights_only=True
    only; an inner zip is checked within the limits first."""
    raw = z.read(entry, "tensors")
    if raw[:2] == b"PK":
        with ZipReader(io.BytesIO(raw), f"{entry} in {description}", z.limits) as inner:
            for n in inner.names:
                inner.check(n, "tensors")
    try:
        t = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ArchiveError(
            f"torch_opaque.load: {what} ('{entry}') in {description} is a pickle that "
            f"torch.load(weights_only=True) refuses ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); torch_opaque never unpickles "
            f"arbitrary objects, so the archive is not loaded."
        ) from e
    if not isinstance(t, torch.Tensor):
        raise ArchiveError(
            f"torch_opaque.load: {what} ('{entry}') in {description} holds a "
            f"{type(t).__name__}, not a tensor."
        )
    return t


def _payloads(z: ZipReader, root: str, kind_dir: str, config_name: str, model: str, description: str) -> dict:
    """FQN -> tensor for the weights or constants of one model."""
    what = "weight" if kind_dir == WEIGHTS_DIR else "constant"
    legacy = f"{root}{kind_dir}{model}.pt"
    if legacy in z.infos:
        raise ArchiveError(
            f"torch_opaque.load: the {what}s of {description} are stored in the legacy pickled "
            f"format ('{legacy}'), which torch_opaque does not unpickle; save the program again "
            f"with a current torch.export.save / torch_opaque.save."
        )
    config_entry = f"{root}{kind_dir}{config_name.format(model)}"
    if config_entry not in z.infos:
        return {}
    serde_schema, serialize = _serde()
    try:
        config = serialize._dict_to_dataclass(
            serde_schema.PayloadConfig, parse_json(z.text(config_entry, "model"), config_entry, description)
        )
        items = list(config.config.items())
    except ArchiveError:
        raise
    except Exception as e:
        raise ArchiveError(
            f"torch_opaque.load: '{config_entry}' in {description} is invalid "
            f"({type(e).__name__}: {e}); the archive is corrupted."
        ) from e
    storages: dict = {}
    out: dict = {}
    for fqn, meta in items:
        part = f"{what} '{fqn}'"
        path = _check_payload_name(meta.path_name, part, description)
        entry = f"{root}{kind_dir}{path}"
        try:
            if kind_dir == CONSTANTS_DIR and not path.startswith("tensor_"):
                raise ArchiveError(
                    f"torch_opaque.load: {part} ('{entry}') in {description} is a custom or "
                    f"opaque object, which only unpickling (running code from the file) could "
                    f"restore; torch_opaque refuses it. Programs with script objects cannot "
                    f"be loaded with torch_opaque.load."
                )
            if meta.use_pickle:
                out[fqn] = _unpickle_tensor(z, entry, part, description)
                continue
            tm = meta.tensor_meta
            if tm is None:
                raise ValueError("it has no tensor metadata")
            dtype = serialize.deserialize_scalar_type(tm.dtype)
            device = serialize.deserialize_device(tm.device)
            if path not in storages:
                nbytes = z.check(entry, "tensors")
                size = serialize.deserialize_size(tm.sizes)
                if nbytes == 0:
                    flat = torch.zeros(size, dtype=dtype).reshape(-1)
                else:
                    elem = torch._utils._element_size(dtype)
                    if nbytes % elem:
                        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
                    flat = torch.frombuffer(bytearray(z.read(entry, "tensors")), dtype=dtype)
                storages[path] = flat
            t = torch.as_strided(
                storages[path],
                serialize.deserialize_size(tm.sizes),
                serialize.deserialize_stride(tm.strides),
                serialize.deserialize_storage_offset(tm.storage_offset),
            )
            if device != torch.device("cpu"):
                t = t.to(device)
            if kind_dir == WEIGHTS_DIR and meta.is_param:
                t = torch.nn.Parameter(t, requires_grad=tm.requires_grad)
            elif tm.requires_grad:
                t.requires_grad_(True)
            out[fqn] = t
        except ArchiveError:
            raise
        except Exception as e:
            raise ArchiveError(
                f"torch_opaque.load: {part} ('{entry}') in {description} cannot be rebuilt "
                f"({type(e).__name__}: {e}); the archive is corrupted."
            ) from e
    return out


# ---- programs ----------------------------------------------------------------------------


def archive_root(z: ZipReader) -> str:
    """The folder every entry of a pt2 archive lives in ('name/')."""
    roots = {n.split("/", 1)[0] for n in z.names}
    if len(roots) != 1 or any("/" not in n for n in z.names):
        raise ArchiveError(
            f"torch_opaque: {z.description} is not a .pt2 archive (its entries are not in one "
            f"folder, as torch.export.save writes them)."
        )
    return next(iter(roots)) + "/"


def model_names(z: ZipReader, root: str) -> list:
    out = []
    for n in z.names:
        rest = n[len(root) :]
        if rest.startswith(MODELS_DIR) and rest.endswith(".json") and "/" not in rest[len(MODELS_DIR) :]:
            out.append(rest[len(MODELS_DIR) : -len(".json")])
    return sorted(out)


def read_model_json(z: ZipReader, root: str, model: str, description: str):
    entry = f"{root}{MODELS_DIR}{model}.json"
    return parse_json(z.text(entry, "model"), entry, description)


def read_tensors(z: ZipReader, root: str, model: str, description: str) -> tuple:
    """(state_dict, constants) of one model, rebuilt from raw bytes (see the Note)."""
    from torch.export.pt2_archive.constants import (
        CONSTANTS_CONFIG_FILENAME_FORMAT,
        WEIGHTS_CONFIG_FILENAME_FORMAT,
    )

    wname = WEIGHTS_CONFIG_FILENAME_FORMAT[len(WEIGHTS_DIR) :]
    cname = CONSTANTS_CONFIG_FILENAME_FORMAT[len(CONSTANTS_DIR) :]
    return (
        _payloads(z, root, WEIGHTS_DIR, wname, model, description),
        _payloads(z, root, CONSTANTS_DIR, cname, model, description),
    )


def deserialize(model_json, tensors: tuple, description: str, where: str, rename: dict):
    """An ExportedProgram from a model's JSON (checked, and renamed in place)
    and its (state_dict, constants); no sample inputs."""
    check_model_json(model_json, where, description, rename)
    state_dict, constants = tensors
    serde_schema, serialize = _serde()
    try:
        serialized = serialize._dict_to_dataclass(serde_schema.ExportedProgram, model_json)
        ep = serialize.ExportedProgramDeserializer(None).deserialize(serialized, state_dict, constants, None)
    except ArchiveError:
        raise
    except Exception as e:
        raise ArchiveError(
            f"torch_opaque.load: cannot load the exported program {where} in {description}: "
            f"{type(e).__name__}: {e}"
        ) from e
    check_graph(ep, where, description)
    return ep


def program_from_bytes(data: bytes, description: str, where: str, limits, rename: dict):
    """A program stored inside a self-contained archive (a whole pt2 archive in
    bytes), read the same way: no sample inputs, no pickles."""
    # a stored program's own graph is bounded by the limit of stored programs
    inner = dataclasses.replace(limits, model=min(limits.model, limits.program), metadata=limits.program * 4)
    with ZipReader(io.BytesIO(data), f"{where} in {description}", inner) as z:
        root = archive_root(z)
        names = model_names(z, root)
        if names != ["model"]:
            raise ArchiveError(
                f"torch_opaque.load: {where} in {description} holds models {names}, not one "
                f"'model'; the archive is corrupted."
            )
        model_json = read_model_json(z, root, "model", z.description)
        check_model_json(model_json, where, description, rename)
        tensors = read_tensors(z, root, "model", description)
    return deserialize(model_json, tensors, description, where, rename)



