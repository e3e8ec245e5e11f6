"""Finding opaque ops: which dispatcher ops are torch_opaque ops, and in which role.

Every opaque op ``ns::Name`` comes with ``ns::Name_fwd`` (training-form
forward, returning residuals) and ``ns::Name_bwd`` (the backward). Ops defined
from Python also know their autograd.Function; ops defined in C++
(torch_opaque/op.h) are recognised from the dispatcher alone.

Example::

    >>> import torch, torch_opaque
    >>> from torch_opaque.ops import opaque_info
    >>> opaque_info(torch.ops.aten.sin.default) is None
    True
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol

import torch

from ._impl.registry import function_for_op

ROLES = ("op", "fwd", "bwd")


@dataclasses.dataclass(frozen=True)
class OpaqueInfo:
    namespace: str
    name: str  # the op's base name, without _fwd / _bwd
    overload: str  # "default" for the default overload
    role: str  # "op", "fwd" or "bwd"
    target: torch._ops.OpOverload
    function: Optional[object]  # the OpaqueFunction, for ops defined from Python

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}::{self.name}"

    def overload_of(self, role: str) -> torch._ops.OpOverload:
        """The OpOverload of this op in another role ("op", "fwd" or "bwd")."""
        suffix = {"op": "", "fwd": "_fwd", "bwd": "_bwd"}[role]
        packet = getattr(getattr(torch.ops, self.namespace), self.name + suffix)
        return getattr(packet, self.overload)

    @property
    def schema(self) -> str:
        return str(self.target._schema)

    @property
    def python_overload(self):
        """The torch_opaque._impl.overload.Overload (Python-defined ops only)."""
        if self.function is None:
            return None
        return self.function.overloads.get(self.overload)


def schema_or_none(ns: str, name: str, overload: str):
    """The registered schema of ``ns::name.overload`` ("default" for none), or None."""
    try:
        return torch._C._get_schema(f"{ns}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        return None


def is_opaque_triple(ns: str, name: str, overload: str) -> bool:
    """Whether ``ns::name`` and its ``_fwd`` / ``_bwd`` companions all exist."""
    return all(schema_or_none(ns, name + s, overload) is not None for s in ("", "_fwd", "_bwd"))


def opaque_info(target) -> Optional[OpaqueInfo]:
    """OpaqueInfo for an OpOverload that is (a role of) an opaque op, else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, _, full = target._schema.name.partition("::")
    overload = target._overloadname
    for role, suffix in (("fwd", "_fwd"), ("bwd", "_bwd"), ("op", "")):
        if suffix and not full.endswith(suffix):
            continue
        base = full[: len(full) - len(suffix)] if suffix else full
        fn = function_for_op(ns, base)
        if fn is None:
            # C++-defined ops: all three companions exist.
            if not is_opaque_triple(ns, base, overload):
                continue
        return OpaqueInfo(ns, base, overload, role, target, fn)
    return None


def opaque_nodes(graph_module) -> list:
    """(node, OpaqueInfo) for every call of an opaque op in a graph."""
    graph = getattr(graph_module, "graph", graph_module)
    out = []
    for n in graph.nodes:
        if n.op == "call_function":
            info = opaque_info(n.target)
            if info is not None:
                out.append((n, info))
    return out


# Note [Op sources]
# ops.py knows the ops Python Functions define (_impl/registry.py) and those
# C++ defines (the dispatcher). A layer that defines opaque ops another way
# (archive/stored.py: ops re-created from stored programs) registers an
# OpSource here when it defines its first op, so that graph passes and the CLI
# ask ops.py and never import that layer.


class OpSource(Protocol):
    def defined_by(self, namespace: str, name: str) -> Optional[str]:
        """'module.Class' of the autograd.Function the op came from, if known."""

    def decomposition(self, info: OpaqueInfo) -> Optional[Callable]:
        """The called op (in its role) as a Python function of ATen ops, or None."""


_SOURCES: list = []


def register_source(source: OpSource) -> None:
    if source not in _SOURCES:
        _SOURCES.append(source)


def defined_by(info: OpaqueInfo) -> Optional[str]:
    """'module.Class' of the autograd.Function behind an opaque op, when known."""
    if info.function is not None:
        cls = info.function.cls
        return f"{cls.__module__}.{cls.__qualname__}"
    for source in _SOURCES:
        found = source.defined_by(info.namespace, info.name)
        if found is not None:
            return found
    return None


def source_decomposition(info: OpaqueInfo) -> Optional[Callable]:
    """The decomposition a registered OpSource has for this call, or None."""
    for source in _SOURCES:
        d = source.decomposition(info)
        if d is not None:
            return d
    return None
