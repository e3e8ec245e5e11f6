"""Which tensors a program loaded from a file may write to.

Note [Writes a loaded program may make]
A loaded graph runs with the caller's tensors as its user inputs and the
archive's weights, buffers and constants as its other placeholders. An
in-place or ``out=`` call (an argument whose schema alias annotation writes,
``Tensor(a!)``) on any of them, or on a view of one, changes state the program
does not own. torch.export records the mutations a program makes in its
signature (``user_inputs_to_mutate``, ``buffers_to_mutate``: outputs that
``ExportedProgram.module()`` copies back); a loaded program may mutate exactly
those, and only as torch.export writes them:

* an ATen-dialect program (``run_decompositions()``, the default of
  ``torch_opaque.save``'s consumers) is functional: every declared mutation is
  an output, so no call of its graph, or of any graph nested in it, may write
  to a placeholder or an alias of one;
* a training-dialect program (``torch.export.export`` without
  ``run_decompositions``) keeps in-place calls and declares nothing: it may
  write its own buffers in place (BatchNorm's running statistics, as torch
  writes them), never a parameter, a constant, or a user input. A program that
  writes its user inputs is refused with the fix: save
  ``ep.run_decompositions()``, whose signature declares the mutation;
* a stored program (the forward or backward of a self-contained op) is the
  body of an op whose schema is functional: it writes none of its inputs and
  declares no mutation.

Aliases are followed through every call whose schema says an output aliases an
argument (views, ``getitem`` of their lists), and into the graphs of
higher-order operators: the placeholders of a nested graph alias whatever
placeholders the operator's operands alias (all of them, conservatively,
when any operand does). Refused at load with an ArchiveError naming the node,
the op, the argument and the placeholder.

Example::

    >>> import torch
    >>> from torch_opaque.archive.writes import undeclared_write
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.add_(1)
    >>> ep = torch.export.export(M(), (torch.ones(2),)).run_decompositions()
    >>> undeclared_write(ep) is None  # the mutation is an output of the signature
    True
"""

from __future__ import annotations

import operator
from typing import Optional

_HOW_FIX = "save ep.run_decompositions(), whose signature declares the mutation"


def _bind(schema, node) -> list:
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


def _nodes_in(value) -> list:
    import torch

    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _nodes_in(v)]
    return [value] if isinstance(value, torch.fx.Node) else []


def _first_write(gm, protected: dict) -> Optional[tuple]:
    """(node, target, argument name, placeholder name) of the first call in
    `gm` (or a graph nested in it) writing a value that aliases a protected one.
    `protected`: node -> the name of the placeholder it aliases."""
    import torch

    aliases = dict(protected)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            if node.args and node.args[0] in aliases:
                aliases[node] = aliases[node.args[0]]
            continue
        if isinstance(target, torch._ops.HigherOrderOperator):
            found = _in_subgraphs(gm, node, aliases)
            if found is not None:
                return found
            continue
        schema = getattr(target, "_schema", None)
        if schema is None:
            continue
        bound = _bind(schema, node)
        for arg, value in bound:
            if arg.alias_info is not None and arg.alias_info.is_write:
                hit = next((n for n in _nodes_in(value) if n in aliases), None)
                if hit is not None:
                    return node, target, arg.name, aliases[hit]
        if any(r.alias_info is not None for r in schema.returns):
            src = next(
                (n for a, v in bound if a.alias_info is not None for n in _nodes_in(v) if n in aliases), None
            )
            if src is not None:
                aliases[node] = aliases[src]
    return None


def _in_subgraphs(gm, node, aliases: dict) -> Optional[tuple]:
    import torch

    operands = [n for n in _nodes_in((node.args, node.kwargs)) if n.op != "get_attr"]
    touched = next((aliases[n] for n in operands if n in aliases), None)
    for n in _nodes_in((node.args, node.kwargs)):
        if n.op != "get_attr":
            continue
        sub = getattr(gm, n.target, None)
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        inner = {} if touched is None else {p: touched for p in sub.graph.nodes if p.op == "placeholder"}
        found = _first_write(sub, inner)
        if found is not None:
            return found
    return None


def _message(found: tuple, where: str, why: str, what: str = "") -> str:
    node, target, arg, name = found
    return f"node '{node.name}' ({target}) writes to {what}{name!r} (its argument '{arg}') in {where}: {why}"


def undeclared_write(ep, where: str = "the program") -> Optional[str]:
    """Why the exported program `ep` writes a tensor its signature does not let
    it write (Note [Writes a loaded program may make]), or None."""
    from torch.export.graph_signature import InputKind

    sig = ep.graph_signature
    training = getattr(ep, "dialect", "ATEN") == "TRAINING"
    kinds = {}
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is not None:
            kinds[name] = spec
    protected = {}
    for n in ep.graph.nodes:
        if n.op != "placeholder":
            continue
        spec = kinds.get(n.name)
        if training and spec is not None and spec.kind == InputKind.BUFFER:
            continue  # training IR writes its own buffers in place (see the Note)
        protected[n] = n.name if spec is None or spec.target is None else spec.target
    found = _first_write(ep.graph_module, protected)
    if found is None:
        return None
    is_user = any(
        s.kind == InputKind.USER_INPUT and (s.arg.name == found[3] or s.target == found[3]) for s in sig.input_specs
    )
    if training and is_user:
        why = (
            "a training-dialect program writes a user input in place, which its signature "
            f"cannot declare; {_HOW_FIX}"
        )
    elif training:
        why = "a loaded program may write only its own buffers in place, not its parameters or constants"
    else:
        why = (
            "the program's signature does not declare this mutation (torch.export writes a "
            "mutation as an output of an ATen-dialect program, never as an in-place call)"
        )
    return _message(found, where, why)


def check_stored_graph(gm, where: str) -> Optional[str]:
    """Why a stored program's graph writes to one of its inputs (or a view of
    one), or None (Note [Writes a loaded program may make])."""
    protected = {n: n.name for n in gm.graph.nodes if n.op == "placeholder"}
    found = _first_write(gm, protected)
    if found is None:
        return None
    why = "a stored program mutates its inputs, which the op's schema declares functional"
    return _message(found, where, why, "its input ")
