"""Schema inference for autograd.Function forwards.

A forward's arguments are described either by its type hints (all of them
annotated) or by the values of a call. Each argument becomes an
:class:`ArgSpec`: the schema type, a short token used in overload names, a
converter from what the dispatcher hands a kernel back to what the user's
forward expects (``SymInt[]`` comes back as a list, a ``torch.Size`` argument
wants a Size), and an optional default.

Example::

    >>> import torch
    >>> from torch_opaque._impl.schema import specs_from_values
    >>> [s.decl for s in specs_from_values(["x", "alpha"], [torch.ones(2), 0.5], {})]
    ['Tensor x', 'float alpha']
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import math
import numbers
import types
import typing
from typing import Any, Callable, Optional, Sequence

import torch

SUPPORTED = (
    "Tensor, Optional[Tensor], list/tuple of Tensors, int/SymInt, float, bool, str, None, "
    "lists of int/float/bool, torch.dtype, torch.device, torch.Size"
)


from ..errors import SchemaError  # noqa: E402,F401


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    name: str
    type: str  # schema type, e.g. "Tensor?", "SymInt[]"
    token: str  # used in overload names
    convert: Optional[Callable[[Any], Any]] = None  # kernel value -> forward value
    default: Any = inspect.Parameter.empty
    # the annotation the spec comes from (None: from a value); for messages only
    hint: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Tensor?")

    @property
    def decl(self) -> str:
        text = f"{self.type} {self.name}"
        literal = _default_literal(self.default, self.type)
        return text if literal is None else f"{text}={literal}"


def schema_arguments(specs: Sequence["ArgSpec"]) -> str:
    """The argument list of an op's schema.

    Defaults the schema can state are shown; Python defaults it cannot (a
    dtype, a device, an int beyond int64, a string with quotes, a value of
    another type than the argument's) are left out, and then so are the
    defaults before them, since a schema argument without a default cannot
    follow one with a default. apply() fills all of them in from the forward's
    signature either way.
    """
    decls = [f"{s.type} {s.name}" for s in specs]
    literals = [_default_literal(s.default, s.type) for s in specs]
    start = 0  # defaults are shown only after the last argument without one
    for i, lit in enumerate(literals):
        if lit is None:
            start = i + 1
    return ", ".join(
        d if i < start else f"{d}={literals[i]}" for i, d in enumerate(decls)
    )


_INT64 = (-(2**63), 2**63 - 1)


def _default_literal(value: Any, typ: str = "") -> Optional[str]:
    """The schema literal of a default for an argument of schema type `typ`,
    or None when the schema cannot state it."""
    if value is inspect.Parameter.empty:
        return None
    base = typ.rstrip("?")
    if value is None:
        return "None" if typ.endswith("?") else None
    if isinstance(value, bool):
        return ("True" if value else "False") if base == "bool" else None
    if type(value) is int:
        ok = base in ("SymInt", "int", "float") and _INT64[0] <= value <= _INT64[1]
        return repr(value) if ok else None
    if type(value) is float:
        return repr(value) if base == "float" and math.isfinite(value) else None
    if type(value) is str:
        ok = base == "str" and value.isprintable() and not any(c in value for c in "\"'")
        return f'"{value}"' if ok else None
    if type(value) in (list, tuple) and base.endswith("[]"):
        elem = base[:-2]
        lits = [_default_literal(v, elem) for v in value]
        if elem in ("SymInt", "int", "float") and all(lits):
            return "[" + ", ".join(lits) + "]"
    return None  # still filled in by apply(); just not shown in the schema


# ---- converters --------------------------------------------------------------


def _to_tuple(v):
    return tuple(v)


def _to_size(v):
    return torch.Size(v)


def _to_optional_tuple(v):
    return None if v is None else tuple(v)


# ---- from values ---------------------------------------------------------------

_SCALARS = {
    bool: ("bool", "bool"),
    int: ("SymInt", "int"),
    float: ("float", "float"),
    str: ("str", "str"),
    torch.SymInt: ("SymInt", "int"),
    torch.SymFloat: ("float", "float"),
    torch.SymBool: ("bool", "bool"),
    torch.dtype: ("ScalarType", "dtype"),
    torch.device: ("Device", "device"),
}


def _spec_from_value(fn_name: str, name: str, value: Any, default: Any) -> ArgSpec:
    if isinstance(value, torch.Tensor):
        return ArgSpec(name, "Tensor", "Tensor", None, default)
    if value is None:
        return ArgSpec(name, "Tensor?", "None", None, default)
    if type(value) is int and not _INT64[0] <= value <= _INT64[1]:
        raise SchemaError(
            f"torch_opaque: {fn_name}: argument '{name}' is the int {value}, beyond the "
            f"64-bit integers an operator schema carries. Pass it as a float or a str, or "
            f"keep this Function unwrapped."
        )
    if type(value) in _SCALARS:
        typ, tok = _SCALARS[type(value)]
        return ArgSpec(name, typ, tok, None, default)
    if isinstance(value, torch.Size):
        return ArgSpec(name, "SymInt[]", "size", _to_size, default)
    if isinstance(value, (list, tuple)):
        is_tuple = isinstance(value, tuple)
        conv = _to_tuple if is_tuple else None
        prefix = "t" if is_tuple else ""
        items = list(value)
        if items and all(isinstance(v, torch.Tensor) for v in items):
            return ArgSpec(name, "Tensor[]", prefix + "Tensors", conv, default)
        if all(isinstance(v, (bool, torch.SymBool)) for v in items) and items:
            return ArgSpec(name, "bool[]", prefix + "bools", conv, default)
        if all(
            isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in items
        ):
            return ArgSpec(name, "SymInt[]", prefix + "ints", conv, default)
        if all(
            isinstance(v, (int, float, torch.SymInt, torch.SymFloat))
            and not isinstance(v, bool)
            for v in items
        ):
            return ArgSpec(name, "float[]", prefix + "floats", conv, default)
        raise SchemaError(
            f"torch_opaque: {fn_name}: argument '{name}' is a {type(value).__name__} mixing "
            f"{sorted({type(v).__name__ for v in items})}; torch_opaque supports {SUPPORTED}. "
            f"Pass a list of one kind, or keep this Function unwrapped."
        )
    raise SchemaError(
        f"torch_opaque: {fn_name}: argument '{name}' has type {type(value).__name__}, which an operator "
        f"schema cannot carry; torch_opaque supports {SUPPORTED}. Pass it as one of "
        f"those, or keep this Function unwrapped."
    )


def specs_from_values(
    names: Sequence[str], values: Sequence[Any], defaults: dict, fn_name: str = "forward"
) -> list:
    return [
        _spec_from_value(fn_name, n, v, defaults.get(n, inspect.Parameter.empty))
        for n, v in zip(names, values)
    ]


def kinds_key(values: Sequence[Any]) -> tuple:
    """A cheap key that tells apart calls needing different overloads."""
    return tuple(
        (type(v), tuple(map(type, v))) if type(v) in (list, tuple) else type(v)
        for v in values
    )


# ---- from type hints --------------------------------------------------------------

_HINT_SCALARS = {
    torch.Tensor: ("Tensor", None),
    int: ("SymInt", None),
    torch.SymInt: ("SymInt", None),
    float: ("float", None),
    bool: ("bool", None),
    str: ("str", None),
    torch.dtype: ("ScalarType", None),
    torch.device: ("Device", None),
    torch.Size: ("SymInt[]", _to_size),
}
_HINT_ELEMS = {torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool"}


def _spec_from_hint(fn_name: str, name: str, hint: Any, default: Any) -> ArgSpec:
    origin = typing.get_origin(hint)
    targs = typing.get_args(hint)
    if hint in _HINT_SCALARS:
        typ, conv = _HINT_SCALARS[hint]
        return ArgSpec(name, typ, typ, conv, default)
    if origin in (typing.Union, types.UnionType) and len(targs) == 2 and type(None) in targs:
        # Optional[X], Union[X, None] and X | None alike
        inner = targs[0] if targs[1] is type(None) else targs[1]
        try:
            base = _spec_from_hint(fn_name, name, inner, default)
        except SchemaError:
            # Optional[Callable] and the like: a call may still pass a value a
            # schema carries (None); infer the schema from the values then.
            raise _FromValues() from None
        if base.type.endswith("?"):
            return base
        conv = base.convert
        if conv is _to_tuple:
            conv = _to_optional_tuple
        return ArgSpec(name, base.type + "?", base.token, conv, default)
    if origin in (typing.Union, types.UnionType) and all(
        _carried_hint(fn_name, name, a, default) for a in targs
    ):
        # Union[float, Tensor] (sinabs' spike thresholds): each kind has a
        # schema, but no one schema carries both as they are; infer it from
        # the values of each call (Note [Hints are advice]).
        raise _FromValues()
    if origin in (list, tuple, collections.abc.Sequence):
        elems = [a for a in targs if a is not Ellipsis]
        if len(set(elems)) == 1 and elems[0] in _HINT_ELEMS:
            conv = _to_tuple if origin is tuple else None
            return ArgSpec(name, _HINT_ELEMS[elems[0]] + "[]", "list", conv, default)
    raise SchemaError(
        f"torch_opaque: {fn_name}: argument '{name}' is annotated as {hint!r}, which an operator schema "
        f"cannot carry; torch_opaque supports {SUPPORTED}. Change the annotation, or "
        f"remove the annotations to infer the schema from the first call."
    )


def _carried_hint(fn_name: str, name: str, hint: Any, default: Any) -> bool:
    """Whether some schema carries values of the kind `hint` names."""
    try:
        _spec_from_hint(fn_name, name, hint, default)
    except SchemaError:
        return False
    except _FromValues:
        return True
    return True


def type_hints(forward: Callable) -> Optional[dict]:
    """``typing.get_type_hints(forward)``, or None when they cannot be resolved.
    (Resolving string annotations compiles each one: callers that need them
    twice pass the result on.)"""
    try:
        return typing.get_type_hints(forward)
    except Exception:
        return None


def specs_from_hints(forward: Callable, names: Sequence[str], defaults: dict, fn_name: str,
                     hints: Optional[dict] = None):
    """Specs from type hints, or None when some argument is not annotated.
    ``hints``: forward's type_hints(), if already resolved."""
    if hints is None:
        hints = type_hints(forward)
    if hints is None:
        return None
    if not all(n in hints for n in names):
        return None
    try:
        return [
            dataclasses.replace(
                _spec_from_hint(fn_name, n, hints[n], defaults.get(n, inspect.Parameter.empty)),
                hint=hints[n],
            )
            for n in names
        ]
    except _FromValues:
        return None


# Note [Hints are advice]
# Python does not check annotations: norse's SuperSpike.forward(ctx,
# input_tensor: torch.Tensor, alpha: float) is called with
# alpha=torch.as_tensor(100.0), and stock runs it. A schema from the hints
# ("float alpha") would turn that call into the dispatcher's "Expected a value
# of type 'float' ... found type 'FakeTensor'" under export, or quietly into a
# float in eager (and truncate a float passed to an `int` hint). So the hints'
# overload serves only the calls whose values it carries as they are
# (hints_accept: a Tensor for Tensor, None or the type for Optional, an int
# for float, which loses nothing, but no float for int, no bool for int or
# float, no 0-dim tensor for a scalar); any other call gets an overload
# inferred from its values, as an unannotated forward would (named by their
# kinds, e.g. Name.Tensor_Tensor, next to the hints' default overload), so the
# forward receives what stock gives it. A call whose values no schema carries
# at all gets a SchemaError naming the class, the argument, its hint, the
# value's type and the fix (specs_for_call). That argument is the one no
# schema inferred from its value carries (a callable surrogate function),
# never merely the first whose hint the value does not match (a 0-dim tensor
# next to it, hinted float). A hint of several kinds that each have a schema
# (Union[float, Tensor]) is no schema of its own: the overloads come from the
# values, as without hints; a hint of a kind no schema carries (dict,
# Callable) is refused when the class is wrapped, naming that argument.


def _accepts(typ: str, v: Any) -> bool:
    """Whether an argument of schema type `typ` (from a hint) carries `v` unchanged."""
    if typ.endswith("?"):
        return v is None or _accepts(typ[:-1], v)
    if typ == "Tensor":
        return isinstance(v, torch.Tensor)
    if isinstance(v, (bool, torch.SymBool)):
        return typ == "bool"
    if typ == "SymInt":
        return isinstance(v, (numbers.Integral, torch.SymInt))
    if typ == "float":
        return isinstance(v, (numbers.Real, torch.SymInt, torch.SymFloat))
    if typ == "bool":
        return False
    if typ == "str":
        return isinstance(v, str)
    if typ == "ScalarType":
        return isinstance(v, torch.dtype)
    if typ == "Device":
        return isinstance(v, torch.device)
    if typ.endswith("[]"):
        return isinstance(v, (list, tuple)) and all(_accepts(typ[:-2], x) for x in v)
    return True  # a type this check does not know: the hint stands


def hints_accept(specs: Sequence[ArgSpec], values: Sequence[Any]) -> bool:
    """Whether the hints' schema carries these values as they are (Note [Hints are advice])."""
    if len(specs) != len(values):
        return False
    for s, v in zip(specs, values):
        if not _accepts(s.type, v):
            return False
    return True


def _hint_text(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__ if hint.__module__ == "builtins" else f"{hint.__module__}.{hint.__qualname__}"
    return repr(hint).replace("typing.", "")


def specs_for_call(hint_specs: Optional[Sequence[ArgSpec]], names: Sequence[str],
                   values: Sequence[Any], defaults: dict, fn_name: str) -> tuple:
    """(specs, overload name) of the overload that a call with these values
    uses: the hints' (overload "") when they carry the values, else inferred
    from the values (Note [Hints are advice])."""
    if hint_specs is not None and hints_accept(hint_specs, values):
        return list(hint_specs), ""
    try:
        specs = specs_from_values(names, values, defaults, fn_name)
    except SchemaError as e:
        if hint_specs is None:
            raise
        spec, value = _uncarried(hint_specs, names, values, defaults, fn_name)
        if spec is None or _accepts(spec.type, value):
            raise  # the hint is not what refuses it: the value's own error names it
        raise SchemaError(
            f"torch_opaque: {fn_name}.forward: argument '{spec.name}' is annotated as "
            f"{_hint_text(spec.hint)}, but this call passes a {type(value).__name__}, which "
            f"neither that annotation's schema ({spec.type}) nor one inferred from the value "
            f"carries ({str(e).removeprefix('torch_opaque: ')}). Pass a "
            f"{_hint_text(spec.hint)} as annotated, or correct the annotation."
        ) from e
    return specs, "_".join(s.token for s in specs) or "noargs"


def _uncarried(hint_specs, names, values, defaults, fn_name) -> tuple:
    """(hint spec, value) of the first argument no schema inferred from its
    value carries: the one a refusal names (Note [Hints are advice]), not
    the first whose hint the value does not match."""
    for spec, n, v in zip(hint_specs, names, values):
        try:
            _spec_from_value(fn_name, n, v, defaults.get(n, inspect.Parameter.empty))
        except SchemaError:
            return spec, v
    return None, None


class _FromValues(Exception):
    """An annotation no schema carries, whose values may still be carriable."""


def returns_from_hint(forward: Callable, hints: Optional[dict] = None) -> Optional[tuple]:
    """(number of outputs, whether forward returns a tuple) from the return hint.
    ``hints``: forward's type_hints(), if already resolved."""
    if hints is None:
        hints = type_hints(forward)
    if hints is None:
        return None
    hint = hints.get("return")
    if hint is torch.Tensor:
        return (1, False)
    if typing.get_origin(hint) is tuple:
        targs = typing.get_args(hint)
        if targs and Ellipsis not in targs and all(a is torch.Tensor for a in targs):
            return (len(targs), True)
    return None
