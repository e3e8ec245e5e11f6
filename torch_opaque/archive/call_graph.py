"""The call graph of the stored programs of self-contained archives, checked at
load (Note [Stored call graph]).

Note [Stored call graph]
A stored program may call other opaque ops, among them ops re-created from
stored programs (a Function whose forward calls another Function). A crafted
manifest can make a stored program call itself, or two call each other: run,
that recursion ends in a RecursionError, or in a SIGSEGV where the caller raised
Python's recursion limit; a long chain costs CPU at every call. So once the
stored programs of an archive are deserialized, and before the loaded program
is returned, the graph "stored overload -> stored overloads its forward and
backward programs call" (ops re-created by earlier loads included) must be
acyclic, and no chain of calls from the loaded program may go deeper than
``ArchiveLimits.call_depth`` (32) stored programs. A refused archive leaves
the overloads it defined without programs (a call fails) and not ready, so
loading it again checks again. The number of stored programs an archive may
hold is bounded too (``ArchiveLimits.programs``, 1000), before any is read.

Example::

    >>> from torch_opaque.archive.call_graph import longest_chain
    >>> longest_chain({"a": {"b"}, "b": set()}, "a")
    2
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import ArchiveError


def called_ops(module) -> set:
    """(namespace, name, overload) of every operator a program's graphs call."""
    out = set()
    for gm in module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                ns, _, name = node.target._schema.name.partition("::")
                out.add((ns, name, node.target._overloadname))
    return out


def stored_callees(sov, lookup: Callable) -> set:
    """The stored overloads (as keys) that the programs of ``sov`` call;
    ``lookup(ns, name, overload)`` gives the key of a stored overload or None."""
    out = set()
    for v in sov.variants:
        for module in (v.fwd, v.bwd):
            if module is None:
                continue
            for ns, name, overload in called_ops(module):
                for base in {name, name.removesuffix("_fwd"), name.removesuffix("_bwd")}:
                    key = lookup(ns, base, overload)
                    if key is not None:
                        out.add(key)
    return out


def longest_chain(edges: dict, start) -> int:
    """How many programs the longest chain of calls from ``start`` runs
    (``start`` included); ValueError naming the cycle if there is one.
    Iterative (a crafted chain must not exhaust Python's stack)."""
    depth: dict = {}
    on_path: list = []
    stack = [(start, iter(sorted(edges.get(start, ()), key=repr)))]
    on_path.append(start)
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            on_path.pop()
            depth[node] = 1 + max((depth[c] for c in edges.get(node, ())), default=0)
            continue
        if nxt in depth:
            continue
        if nxt in on_path:
            cycle = on_path[on_path.index(nxt):] + [nxt]
            raise ValueError(" -> ".join(map(str, cycle)))
        on_path.append(nxt)
        stack.append((nxt, iter(sorted(edges.get(nxt, ()), key=repr))))
    return depth[start]


def check_call_graph(created: Iterable, all_stored: dict, description: str, limit: int) -> None:
    """Note [Stored call graph]: refuses a cycle, or a chain deeper than
    ``limit``, among the stored overloads (``all_stored``: key -> overload)
    reachable from those this load ``created``."""

    def lookup(ns, name, overload):
        key = (ns, name, overload)
        return key if key in all_stored else None

    def label(key) -> str:
        ns, name, overload = key
        sov = all_stored[key]
        return f"{ns}::{name}.{sov.overload}"

    edges = {k: stored_callees(sov, lookup) for k, sov in all_stored.items()}
    for sov in created:
        key = (sov.op.namespace, sov.op.name, sov.registered)
        try:
            depth = longest_chain(edges, key)
        except ValueError:
            cycle = _cycle_from(edges, key)
            raise ArchiveError(
                f"torch_opaque.load: the stored programs of {description} call each other in a "
                f"cycle ({' -> '.join(label(k) for k in cycle)}): running them would recurse "
                f"without end. The archive was crafted or corrupted; it is not loaded."
            ) from None
        if depth > limit:
            raise ArchiveError(
                f"torch_opaque.load: the stored programs of {description} call each other "
                f"{depth} deep (from {label(key)}), more than the call_depth limit of {limit}. "
                f"Raise it with limits=ArchiveLimits(call_depth=...) if you trust the file."
            )


def _cycle_from(edges: dict, start) -> list:
    """One cycle reachable from ``start`` (keys), for the message."""
    path, seen = [start], {start}
    stack = [iter(sorted(edges.get(start, ()), key=repr))]
    while stack:
        nxt = next(stack[-1], None)
        if nxt is None:
            stack.pop()
            path.pop()  # (explored: it reaches no cycle through the path)
            continue
        if nxt in path:
            return path[path.index(nxt):] + [nxt]
        if nxt in seen:
            continue
        path.append(nxt)
        seen.add(nxt)
        stack.append(iter(sorted(edges.get(nxt, ()), key=repr)))
    return [start, start]
