"""The serialized graph of an exported program (``models/<name>.json``) read
against a closed grammar before torch's deserializer sees any of it.

Note [The graph grammar]
torch's deserializer turns parts of the JSON into code: names become Python
source when FX generates a GraphModule's ``forward`` (a ``\\r`` or a quote in a
name starts a line of its own), expression strings go to ``sympy.sympify``,
call targets are resolved by ``getattr`` walks, guards are ``exec()``'d. So
every part is checked here first, walking the JSON with the types of torch's
own schema (``torch._export.serde.schema``, the same dataclasses the
deserializer fills):

* every object has only the fields of its schema class, every value the
  field's type (ints within int64, floats as torch writes them, enums by
  value), every union exactly one known tag;
* names that become code (values, nodes, keyword arguments, placeholders,
  graph names, parameter / buffer / constant paths that become ``get_attr``
  targets) are plain ASCII identifiers, or dotted paths of them;
* call targets, and operators passed as arguments (``as_operator``), are
  operators a loaded program may call (:mod:`.op_policy`);
* symbolic expressions are parsed by our own parser (:mod:`.sym_expr`) and the
  finished sympy objects replace the text, so sympy never parses file text;
* guards are parsed and checked (:func:`check_guard`) and re-written from the
  checked tree; node metadata is printable text (newlines only in stack traces);
* the numbers of nodes and of nested graphs are bounded (ArchiveLimits.nodes).

Anything else is an ArchiveError naming the part (a JSON path such as
``graph_module.graph.nodes[3].inputs[0].name``).

Example::

    >>> from torch_opaque.archive.graph_grammar import check_name
    >>> check_name("add_1"), check_name("x\\rimport os")
    (None, 'it is not a valid name (a plain ASCII identifier)')
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import keyword
import re
import types
import typing
from typing import Any, Optional

from ..errors import ArchiveError
from . import op_policy
from .sym_expr import SYMBOL_RE, SymBudget, SymExprError, parse_sym_expr

INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_NAME = 256
MAX_TEXT = 1 << 20
MAX_GRAPH_DEPTH = 32

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# parameter / buffer / module paths: segments may be list indices ('layers.0.weight')
_PATH_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_CALL_FQN_RE = re.compile(r"^([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?(@[0-9]{1,9})?$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9.+_<=>~!-]{1,64}$")
_DEVICE_TYPE_RE = re.compile(r"^[a-z_]{1,32}$")
_RANGE_KEY_RE = re.compile(r"^[A-Za-z0-9_ +*/%(),.<>=!-]+$")


def check_name(s) -> Optional[str]:
    """Why `s` cannot be a name FX writes into code, or None."""
    if not isinstance(s, str) or len(s) > MAX_NAME or not _IDENT_RE.match(s):
        return "it is not a valid name (a plain ASCII identifier)"
    if keyword.iskeyword(s):
        return "it is a Python keyword"
    return None


def _pattern(regex, what):
    def check(s):
        if not isinstance(s, str) or len(s) > MAX_NAME or not regex.match(s):
            return f"it is not {what}"
        return None

    return check


_FORMAT_CHARS = "\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff"
_CONTROL = re.compile(f"[\\x00-\\x08\\x0a-\\x1f\\x7f-\\x9f{_FORMAT_CHARS}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_FORMAT_CHARS}]")


def _printable(newlines: bool, limit: int = MAX_TEXT):
    """Text with no control, format or line-separator characters (tabs allowed,
    newlines only where `newlines`)."""
    bad = _CONTROL_BUT_NEWLINE if newlines else _CONTROL

    def check(s):
        if not isinstance(s, str):
            return "it is not text"
        if len(s) > limit:
            return f"it is longer than {limit} characters"
        m = bad.search(s)
        if m is not None:
            return f"it holds the control character {m.group()!r} at offset {m.start()}"
        return None

    return check


def _any_text(s):
    if not isinstance(s, str) or len(s) > MAX_TEXT:
        return "it is not text of at most 1 MiB"
    return None


_text = _printable(False)
_PATH = _pattern(_PATH_RE, "a dotted path of identifiers")
# (schema class, field) -> check of a str field (or of the keys of a dict field).
_STR_RULES = {
    ("TensorArgument", "name"): check_name,
    ("TokenArgument", "name"): check_name,
    ("SymIntArgument", "as_name"): check_name,
    ("SymFloatArgument", "as_name"): check_name,
    ("SymBoolArgument", "as_name"): check_name,
    ("GraphArgument", "name"): check_name,
    ("CustomObjArgument", "name"): check_name,
    ("CustomObjArgument", "class_fqn"): _PATH,
    ("NamedArgument", "name"): lambda s: None if s == "" else check_name(s),  # "": positional
    ("Node", "name"): check_name,
    ("Argument", "as_string"): _any_text,  # repr()'d by FX: any text is inert
    ("Argument", "as_strings"): _any_text,
    ("ConstantValue", "as_string"): _any_text,
    ("InputToConstantInputSpec", "name"): check_name,
    ("InputToParameterSpec", "parameter_name"): _PATH,
    ("InputToBufferSpec", "buffer_name"): _PATH,
    ("InputToTensorConstantSpec", "tensor_constant_name"): _PATH,
    ("InputToCustomObjSpec", "custom_obj_name"): _PATH,
    ("BufferMutationSpec", "buffer_name"): _PATH,
    ("ParameterMutationSpec", "parameter_name"): _PATH,
    ("GradientToParameterSpec", "parameter_name"): _PATH,
    ("GradientToUserInputSpec", "user_input_name"): check_name,
    ("UserInputMutationSpec", "user_input_name"): check_name,
    ("ModuleCallEntry", "fqn"): _pattern(_CALL_FQN_RE, "a module path"),
    ("ModuleCallSignature", "in_spec"): _text,  # JSON, read by pytree's closed registry
    ("ModuleCallSignature", "out_spec"): _text,
    ("ModuleCallSignature", "forward_arg_names"): check_name,
    ("NamedTupleDef", "field_names"): check_name,
    ("ExportedProgram", "verifiers"): check_name,
    ("ExportedProgram", "torch_version"): _pattern(_VERSION_RE, "a version"),
    ("Device", "type"): _pattern(_DEVICE_TYPE_RE, "a device type"),
    # dict keys
    ("Graph", "tensor_values"): check_name,
    ("Graph", "sym_int_values"): check_name,
    ("Graph", "sym_bool_values"): check_name,
    ("Graph", "sym_float_values"): check_name,
    ("Graph", "custom_obj_values"): check_name,
    # keys: str() of a size symbol or expression ('s0', '4*s57 - 1'), only compared with
    # the str() of the expressions the graph holds, never parsed
    ("ExportedProgram", "range_constraints"): _pattern(_RANGE_KEY_RE, "a size expression"),
    ("ExportedProgram", "opset_version"): check_name,
    ("GraphModule", "metadata"): check_name,
    ("GraphModule", "treespec_namedtuple_fields"): _PATH,
    ("Node", "metadata"): check_name,
}
# metadata values: printable; newlines only in stack traces.
_META_VALUE = {"stack_trace": _printable(True)}
_SOURCE_FN_RE = re.compile(r"^[A-Za-z0-9_]+,[A-Za-z0-9_.<>]+$")


def _schema():
    from torch._export.serde import schema, union

    return schema, union


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    schema, _ = _schema()
    return typing.get_type_hints(cls, globalns=vars(schema))


@functools.lru_cache(maxsize=None)
def _kind(tp) -> tuple:
    """(kind, parameter) of a schema type, worked out once per type."""
    schema, union = _schema()
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _kind(tp.__origin__)
    if origin in (typing.Union, types.UnionType):
        (arg,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return "optional", arg
    if isinstance(tp, typing.ForwardRef):
        return _kind(getattr(schema, tp.__forward_arg__))
    if isinstance(tp, str):
        return _kind(getattr(schema, tp))
    if isinstance(tp, type) and issubclass(tp, union._Union):
        return "union", tp
    if dataclasses.is_dataclass(tp):
        return "dataclass", tp
    if origin is list:
        return "list", typing.get_args(tp)[0]
    if origin is dict:
        return "dict", typing.get_args(tp)[1]
    if isinstance(tp, type) and issubclass(tp, enum.IntEnum):
        return "enum", tp
    return {str: "str", bool: "bool", int: "int", float: "float"}.get(tp, "unknown"), None


class _Invalid(Exception):
    def __init__(self, path: str, why: str):
        self.path, self.why = path, why


@dataclasses.dataclass
class ProgramFacts:
    """What the walk found: the call targets (with counts) and the nodes."""

    targets: dict = dataclasses.field(default_factory=dict)
    nodes: int = 0
    program: Any = None  # the schema ExportedProgram built from the checked JSON


class _Walker:
    def __init__(self, limits, rename: dict, custom_ok):
        self.schema, union = _schema()
        self.Union = union._Union
        self.limits = limits
        self.rename = rename
        self.custom_ok = custom_ok  # str target -> whether a non-builtin op may be called
        self.facts = ProgramFacts()
        self.graph_depth = 0
        self.sym_budget = SymBudget.of(limits)  # Note [Symbolic work] in sym_expr.py

    def walk(self, tp, v, path: str, owner: str = "", field: str = ""):
        """The schema object `v` stands for, built from checked parts only."""
        kind, arg = _kind(tp)
        if kind == "optional":
            return None if v is None else self.walk(arg, v, path, owner, field)
        if kind == "union":
            return self.union(arg, v, path)
        if kind == "dataclass":
            return self.obj(arg, v, path)
        if kind == "list":
            if not isinstance(v, list):
                raise _Invalid(path, "it is not a list")
            return [self.walk(arg, x, f"{path}[{i}]", owner, field) for i, x in enumerate(v)]
        if kind == "dict":
            if not isinstance(v, dict):
                raise _Invalid(path, "it is not an object")
            key_rule = _STR_RULES.get((owner, field), _text)
            out = {}
            for k, x in v.items():
                why = key_rule(k)
                if why is not None:
                    raise _Invalid(f"{path}[{k!r:.60}]", f"(this key) {why}")
                out[k] = self.walk(arg, x, f"{path}[{k!r:.60}]", owner, field)
            return out
        if kind == "str":
            if owner == "SymExpr" and field == "expr_str":
                return self.expr(v, path)
            why = _STR_RULES.get((owner, field), _text)(v)
            if why is not None:
                raise _Invalid(path, why)
            return v
        if kind == "bool":
            if not isinstance(v, bool):
                raise _Invalid(path, "it is not true or false")
            return v
        if kind == "int":
            if not isinstance(v, int) or isinstance(v, bool) or not INT64[0] <= v <= INT64[1]:
                raise _Invalid(path, "it is not an integer in the int64 range")
            return v
        if kind == "float":
            if isinstance(v, str) and v in ("Infinity", "-Infinity", "NaN"):
                return float(v)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise _Invalid(path, "it is not a number")
            return float(v)
        if kind == "enum":
            if not isinstance(v, int) or isinstance(v, bool) or v not in arg._value2member_map_:
                raise _Invalid(path, f"it is not a {arg.__name__} value")
            return v
        raise _Invalid(path, f"torch_opaque does not read values of type {tp!r}")

    def union(self, tp, v, path: str):
        hints = _hints(tp)
        if not isinstance(v, dict) or len(v) != 1:
            raise _Invalid(path, f"a {tp.__name__} is an object with one key")
        ((tag, body),) = v.items()
        if tag not in hints:
            raise _Invalid(path, f"{tag!r:.60} is not a kind of {tp.__name__}")
        if tp.__name__ == "Argument" and tag == "as_operator":
            return tp.create(as_operator=self.operator(body, f"{path}.as_operator"))
        if tp.__name__ == "Argument" and tag == "as_graph":
            self.graph_depth += 1
            if self.graph_depth > MAX_GRAPH_DEPTH:
                raise _Invalid(path, f"graphs are nested more than {MAX_GRAPH_DEPTH} deep")
            out = tp.create(as_graph=self.walk(hints[tag], body, f"{path}.{tag}", tp.__name__, tag))
            self.graph_depth -= 1
            return out
        return tp.create(**{tag: self.walk(hints[tag], body, f"{path}.{tag}", tp.__name__, tag)})

    def obj(self, tp, v, path: str):
        if not isinstance(v, dict):
            raise _Invalid(path, f"a {tp.__name__} is an object")
        hints = _hints(tp)
        name = tp.__name__
        fields = {}
        for k, x in v.items():
            if k not in hints:
                raise _Invalid(
                    f"{path}.{k!s:.60}",
                    f"{name} has no such field in torch's schema (was the archive written by a "
                    f"newer torch?)",
                )
            if name == "Node" and k == "target":
                self.node(v, path)
                fields[k] = self.operator(x, f"{path}.target")
            elif name == "Node" and k == "metadata":
                fields[k] = self.metadata(x, f"{path}.metadata")
            elif name == "ExportedProgram" and k == "guards_code":
                fields[k] = self.guards(x, f"{path}.guards_code")
            else:
                fields[k] = self.walk(hints[k], x, f"{path}.{k}", name, k)
        if name == "Node" and "target" not in v:
            raise _Invalid(path, "a node has a target")
        try:
            return tp(**fields)
        except TypeError as e:  # a required field is missing
            raise _Invalid(path, f"it is not a complete {name} ({e})") from None

    def node(self, v: dict, path: str) -> None:
        self.facts.nodes += 1
        if self.facts.nodes > self.limits.nodes:
            raise _Invalid(
                path,
                f"the program has more than {self.limits.nodes} nodes (raise it with "
                f"limits=ArchiveLimits(nodes=...) if you trust the file)",
            )

    def metadata(self, meta, path: str) -> dict:
        if not isinstance(meta, dict):
            raise _Invalid(path, "it is not an object")
        for k, s in meta.items():
            p = f"{path}[{k!r:.40}]"
            why = check_name(k) or _META_VALUE.get(k, _text)(s)
            if why is None and k == "source_fn_stack":
                if not all(_SOURCE_FN_RE.match(item) for item in s.split(";")):
                    why = "it is not a list of 'name,target' pairs"
            if why is not None:
                raise _Invalid(p, why)
        return dict(meta)

    def operator(self, t, path: str) -> str:
        why = op_policy.check_target(t, self.custom_ok)
        if why is not None:
            raise _Invalid(path, why)
        self.facts.targets[t] = self.facts.targets.get(t, 0) + 1
        return self.rename.get(t, t)

    def expr(self, v, path: str):
        try:
            return parse_sym_expr(v, self.sym_budget)
        except SymExprError as e:
            raise _Invalid(path, f"the symbolic expression {str(v)[:60]!r} is not plain arithmetic of "
                                 f"sizes ({e})") from None  # fmt: skip

    def guards(self, guards, path: str) -> list:
        if not isinstance(guards, list):
            raise _Invalid(path, "it is not a list")
        out = []
        for i, g in enumerate(guards):
            tree, why = check_guard(g)
            if why is not None:
                raise _Invalid(
                    f"{path}[{i}]",
                    f"the guard {str(g)[:80]!r} is not a plain check of input sizes ({why}); torch "
                    f"would run it as Python code",
                )
            out.append(ast.unparse(tree))
        return out


# ---- guards ----------------------------------------------------------------------------------

# ExportedProgram.module() turns the program's guards_code into Python source
# and exec()s it; each guard must be a comparison of input sizes, and what
# torch runs is our own rendering of the checked tree.
_GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_FUNCS = {"Max", "Min", "abs", "int", "float", "bool"}
_GUARD_NODES = (
    ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Constant, ast.Subscript,
    ast.Call, ast.Name, ast.Attribute, ast.Load, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.Eq, ast.NotEq,
    ast.Lt, ast.LtE, ast.Gt, ast.GtE,
)  # fmt: skip


def check_guard(code) -> tuple:
    """(parsed tree, None) for a guard that is a plain check of input sizes,
    else (None, why)."""
    if not isinstance(code, str) or len(code) > 10_000:
        return None, "it is not a short string"
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return None, f"it does not parse ({type(e).__name__})"
    for node in ast.walk(tree):
        why = _guard_node(node)
        if why is not None:
            return None, why
    return tree, None


def _guard_node(node) -> Optional[str]:
    if not isinstance(node, _GUARD_NODES):
        return f"{type(node).__name__} is not allowed"
    if isinstance(node, ast.Name) and node.id != "L" and node.id not in _GUARD_FUNCS:
        return f"unknown name {node.id!r}"
    if isinstance(node, ast.Constant):
        value = node.value
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            return f"constant {value!r} is not allowed"
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            return "an integer outside the int64 range"
        if isinstance(value, str) and check_name(value) is not None:
            return f"key {value!r} is not an input name"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        e = node.right
        if not (isinstance(e, ast.Constant) and isinstance(e.value, int) and 0 <= e.value <= 64):
            return "a power whose exponent is not a small integer"
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


# ---- entry point -----------------------------------------------------------------------------


def check_program_json(model, where: str, description: str, limits, rename: dict, custom_ok) -> ProgramFacts:
    """Reads a model JSON against the grammar (Note [The graph grammar]) and
    builds torch's schema objects from the checked parts: expressions become
    sympy objects, guards our rendering, call targets are renamed by `rename`.
    `custom_ok(target)` says whether an operator outside torch's own namespaces
    may be called. ArchiveError names the part; the JSON is not changed. The
    built ``torch._export.serde.schema.ExportedProgram`` is ``facts.program``."""
    schema, _ = _schema()
    w = _Walker(limits, rename, custom_ok)
    try:
        w.facts.program = w.walk(schema.ExportedProgram, model, "program")
        calls = getattr(w.facts.program.graph_module, "module_call_graph", None) or []
        if calls and calls[0].fqn != "":
            raise _Invalid("program.graph_module.module_call_graph[0].fqn", "the first entry is the root module ('')")
    except _Invalid as e:
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} is not a program torch_opaque loads: "
            f"{e.path}: {e.why}. The archive was crafted or corrupted; it is not loaded."
        ) from None
    except RecursionError:
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} is nested too deeply to be a program; "
            f"the archive was crafted or corrupted."
        ) from None
    return w.facts
