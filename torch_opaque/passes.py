"""Graph passes over exported programs that contain opaque ops.

Each pass takes a ``torch.export.ExportedProgram`` and returns a new, valid
program (the input is left unchanged) that runs and computes what the original
computes:

* :func:`list_opaque_ops` -- which opaque ops a program calls, how often;
* :func:`inline` -- replace opaque calls by their forward in ATen ops;
* :func:`replace` -- substitute a Python function (or another op) for an op;
* :func:`strip_residuals` -- turn training-form ``Name_fwd`` calls whose
  residuals nobody uses back into ``Name`` calls.

``inline`` and ``replace`` run ``ExportedProgram.run_decompositions`` with a
decomposition table that holds only the chosen opaque ops, so the rest of the
program is retraced unchanged (dynamic shapes, parameters and the signature
stay valid), and the chosen calls are traced through the given Python code.
After ``inline`` gradients come from autograd through the inlined ATen ops,
not from the Function's custom backward.

Ops are chosen (``ops=``/``op=``) by autograd.Function class, OpaqueFunction,
OpOverload or OpOverloadPacket (any of the three roles), or a string
``"ns::Name"`` / ``"ns::Name.overload"``; ``ops=`` also takes a list, tuple or
set of those.

Example::

    >>> import torch, torch_opaque
    >>> from torch_opaque import passes
    >>> @torch_opaque.op(name="DocPassSin")
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
    ...         return DocSin.apply(x) + 1
    >>> ep = torch.export.export(M(), (torch.randn(3),))
    >>> [(r.qualified_name, r.count) for r in passes.list_opaque_ops(ep)]
    [('opaque::DocPassSin', 1)]
    >>> passes.list_opaque_ops(passes.inline(ep))
    []
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, Callable, Optional

import torch

from ._impl.calls import CallSignature, full_args
from ._impl.cpp_kernels import CppBackward, CppRunner
from ._impl.tracing import unalias
from ._impl.function import OpaqueFunction, lookup
from ._impl.kernels import BackwardRunner, Runner
from .ops import OpaqueInfo, defined_by, opaque_info, opaque_nodes, source_decomposition

__all__ = ["OpaqueOpRecord", "list_opaque_ops", "inline", "replace", "strip_residuals"]

_ROLE_ORDER = {"op": 0, "fwd": 1, "bwd": 2}


@dataclasses.dataclass(frozen=True)
class OpaqueOpRecord:
    """One opaque operator overload called by a program."""

    qualified_name: str  # "ns::Name" (the op, whatever the role)
    overload: str  # "default" for the default overload
    role: str  # "op", "fwd" (training-form forward) or "bwd"
    target: str  # the called operator: "ns::Name_fwd.overload"
    schema: str  # the called operator's schema
    count: int  # number of calls (nested graphs included)
    defined_by: Optional[str]  # "module.Class" of the autograd.Function, when known


def _check_program(ep) -> None:
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(
            f"torch_opaque.passes expects a torch.export.ExportedProgram, got {type(ep).__name__}"
        )


def _graph_modules(gm) -> list:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _all_opaque(gm) -> list:
    out = []
    for m in _graph_modules(gm):
        out += opaque_nodes(m)
    return out


def list_opaque_ops(ep) -> list:
    """An :class:`OpaqueOpRecord` per opaque operator overload the program calls."""
    _check_program(ep)
    counts: dict = {}
    infos: dict = {}
    for _node, info in _all_opaque(ep.graph_module):
        key = (info.namespace, info.name, info.overload, info.role)
        counts[key] = counts.get(key, 0) + 1
        infos[key] = info
    records = []
    for key in sorted(counts, key=lambda k: (k[0], k[1], k[2], _ROLE_ORDER[k[3]])):
        info = infos[key]
        schema = info.target._schema
        records.append(
            OpaqueOpRecord(
                qualified_name=info.qualified_name,
                overload=info.overload,
                role=info.role,
                target=f"{schema.name}.{info.overload}",
                schema=str(schema),
                count=counts[key],
                defined_by=defined_by(info),
            )
        )
    return records


# ---- choosing ops ----------------------------------------------------------------------


def _selector_key(item) -> tuple:
    """(namespace, name, overload or None) for one way of naming an opaque op."""
    if isinstance(item, OpaqueFunction):
        return (item.namespace, item.name, None)
    if isinstance(item, type) and issubclass(item, torch.autograd.Function):
        fn = lookup(item)
        if fn is None:
            raise ValueError(
                f"torch_opaque.passes: {item.__qualname__} is not wrapped by torch_opaque, so "
                f"no program calls it as an op."
            )
        return (fn.namespace, fn.name, None)
    if isinstance(item, torch._ops.OpOverload):
        info = opaque_info(item)
        if info is None:
            raise ValueError(f"torch_opaque.passes: {item} is not an opaque op.")
        return (info.namespace, info.name, info.overload)
    if isinstance(item, torch._ops.OpOverloadPacket):
        item = item._qualified_op_name
    if isinstance(item, str):
        ns, sep, rest = item.partition("::")
        if not sep or not ns or not rest:
            raise ValueError(
                f"torch_opaque.passes: expected 'namespace::Name' or 'namespace::Name.overload', "
                f"got {item!r}."
            )
        name, _, overload = rest.partition(".")
        for suffix in ("_fwd", "_bwd"):
            if name.endswith(suffix) and _has_op(ns, name[: -len(suffix)]):
                name = name[: -len(suffix)]
        return (ns, name, overload or None)
    raise TypeError(
        f"torch_opaque.passes: cannot name an op with a {type(item).__name__}; pass an "
        f"autograd.Function class, an OpOverload/OpOverloadPacket or 'namespace::Name'."
    )


def _has_op(ns: str, name: str) -> bool:
    try:
        return bool(torch._C._jit_get_schemas_for_operator(f"{ns}::{name}"))
    except RuntimeError:
        return False


def _chooser(ops, nodes: list) -> Callable[[OpaqueInfo], bool]:
    if ops is None:
        return lambda info: True
    if isinstance(ops, (str, type, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or not (
        isinstance(ops, (list, tuple, set, frozenset))
    ):
        ops = [ops]
    keys = [_selector_key(o) for o in ops]

    def chosen(info: OpaqueInfo) -> bool:
        return any(
            k[0] == info.namespace and k[1] == info.name and k[2] in (None, info.overload)
            for k in keys
        )

    present = sorted({f"{i.namespace}::{i.name}.{i.overload}" for _, i in nodes})
    for k in keys:
        if not any(
            k[0] == i.namespace and k[1] == i.name and k[2] in (None, i.overload) for _, i in nodes
        ):
            name = f"{k[0]}::{k[1]}" + (f".{k[2]}" if k[2] else "")
            raise ValueError(
                f"torch_opaque.passes: the program does not call {name}; it calls "
                f"{', '.join(present) or 'no opaque op'}."
            )
    return chosen


# ---- decompositions ------------------------------------------------------------------------


def _python_decomposition(info: OpaqueInfo) -> Optional[Callable]:
    """The Function's own forward (or backward) as a decomposition of the called op."""
    fn = info.function
    ov = fn.overloads.get(info.overload) if fn is not None else None
    if ov is None:
        return None
    schema = info.target._schema
    if info.role == "bwd":
        runner = BackwardRunner(fn.display_name, fn.cls.backward, ov.specs)

        def backward(saved, grads, needs_input_grad, state, state_ints):
            return list(runner(saved, grads, needs_input_grad, state, state_ints)[0])

        return backward

    setup = fn.cls.setup_context if fn.setup_style else None
    runner = Runner(fn.display_name, fn.cls.forward, setup, ov.specs, ov.n_out)
    training = info.role == "fwd"

    sig = CallSignature.of_schema(schema)

    def forward(*args, **kwargs):
        args, kwargs, needs = sig.split_needs_input_grad(args, kwargs)
        args = sig.complete(args, kwargs)
        if training and needs is None:
            needs = tuple(s.is_tensor and a is not None for s, a in zip(ov.specs, args))
        elif not training:
            needs = None
        # Grad mode is left alone (toggling it would be recorded in the graph);
        # outputs and residuals that alias inputs come back as copies.
        outs, residuals, _record = runner.run(needs, args)
        if training:
            return (*outs, list(residuals))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return forward


def _cpp_decomposition(info: OpaqueInfo) -> Optional[Callable]:
    """An op defined in C++ (torch_opaque/op.h) as its own kernels run below
    autograd (Note [Kernels below autograd]): the trace records the ATen ops
    they call. A kernel that is not made of ATen ops (a loop over data_ptr)
    fails to trace, with the error naming the node."""
    if info.function is not None or not _has_op(info.namespace, info.name + "_fwd"):
        return None
    if info.role == "bwd":
        backward = CppBackward(info.namespace, info.name, info.overload)
        return lambda saved, grads, needs, state, state_ints: backward(
            saved, grads, needs, state, state_ints
        )
    runner = CppRunner(info.namespace, info.name, info.overload)
    sig = CallSignature.of_schema(info.target._schema)
    training = info.role == "fwd"

    def forward(*args, **kwargs):
        args, kwargs, needs = sig.split_needs_input_grad(args, kwargs)
        args = sig.complete(args, kwargs)
        outs, residuals, _record = runner.run(needs if training else None, args)
        if training:
            return (*outs, list(residuals))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return forward


def _decomposition(info: OpaqueInfo) -> Callable:
    d = _python_decomposition(info) or source_decomposition(info) or _cpp_decomposition(info)
    if d is None:
        raise ValueError(
            f"torch_opaque.passes.inline: {info.qualified_name}.{info.overload} has no forward "
            f"in this process to inline (its Function was not imported); import the module "
            f"that defines it, or leave it out of ops=."
        )
    return d


# ---- graph surgery ----------------------------------------------------------------------------


def _new_program(ep, gm):
    """An ExportedProgram like `ep` with a rewritten graph module (same signature)."""
    gm.recompile()
    return torch.export.ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=_signature_for(ep.graph_signature, gm.graph),
        state_dict=ep.state_dict,
        range_constraints=copy.deepcopy(ep.range_constraints),
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )


def _signature_for(signature, graph):
    """A copy of ``signature`` whose output specs name the nodes that ``graph``'s
    output node now returns (a rewrite may have replaced a returned node)."""
    signature = copy.deepcopy(signature)
    returned = list(graph.output_node().args[0])
    for spec, node in zip(signature.output_specs, returned):
        arg = spec.arg
        if isinstance(node, torch.fx.Node) and hasattr(arg, "name") and arg.name != node.name:
            spec.arg = dataclasses.replace(arg, name=node.name)
    return signature


def _getitem_users(node) -> Optional[dict]:
    """index -> getitem node for the users of a multi-output node, or None when
    some user is not a getitem with a constant index."""
    out: dict = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        idx = u.args[1]
        if not isinstance(idx, int):
            return None
        out.setdefault(idx, []).append(u)
    return out


def _dead(node) -> bool:
    """Whether a node only feeds getitems nobody uses."""
    return all(
        u.op == "call_function" and u.target is operator.getitem and _dead(u) for u in node.users
    )


def _erase_tree(node) -> None:
    for u in list(node.users):
        _erase_tree(u)
    node.graph.erase_node(node)


def _residuals_unused(node, n_out: int) -> bool:
    users = _getitem_users(node)
    if users is None:
        return False
    return all(_dead(g) for g in users.get(n_out, []))


def _prune_dead_residuals(gm) -> bool:
    """Removes unused getitems on the residual lists of `_fwd` calls (a retrace of
    a `_fwd` call outside autograd yields no residuals to index)."""
    changed = False
    for m in _graph_modules(gm):
        for node, info in opaque_nodes(m):
            if info.role != "fwd":
                continue
            n_out = len(info.overload_of("op")._schema.returns)
            users = _getitem_users(node) or {}
            for g in users.get(n_out, []):
                if _dead(g):
                    _erase_tree(g)
                    changed = True
        if changed:
            m.recompile()
    return changed


def _strip(gm, chosen, strict: bool) -> int:
    """Rewrites chosen `_fwd` calls with unused residuals into op calls in place."""
    n = 0
    for m in _graph_modules(gm):
        touched = False
        for node, info in opaque_nodes(m):
            if info.role != "fwd" or not chosen(info):
                continue
            op = info.overload_of("op")
            n_out = len(op._schema.returns)
            users = _getitem_users(node)
            if users is None or not _residuals_unused(node, n_out):
                if not strict:
                    continue
                if users is None:
                    why = "its outputs are used other than through getitem"
                else:
                    readers = sorted(u.name for g in users.get(n_out, []) for u in g.users)
                    why = f"its residuals are used by {', '.join(readers)}"
                raise ValueError(
                    f"torch_opaque.passes.strip_residuals: cannot rewrite node '{node.name}' "
                    f"({info.qualified_name}_fwd.{info.overload}) into "
                    f"{info.qualified_name}.{info.overload}: {why}. The program is a training "
                    f"graph that needs them for the backward; keep the node."
                )
            graph = m.graph
            with graph.inserting_before(node):
                # drop `_fwd`'s trailing needs_input_grad argument
                args, kwargs, _ = CallSignature.of_schema(op._schema).split_needs_input_grad(
                    node.args, node.kwargs
                )
                new = graph.call_function(op, args, kwargs)
            new.meta = dict(node.meta)
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                new.meta["val"] = val[0] if n_out == 1 else tuple(val[:n_out])
            for g in users.get(n_out, []):
                _erase_tree(g)
            for idx, gs in users.items():
                if idx >= n_out:
                    continue
                for g in gs:
                    if n_out == 1:
                        g.replace_all_uses_with(new)
                        graph.erase_node(g)
                    else:
                        g.update_arg(0, new)
            graph.erase_node(node)
            n += 1
            touched = True
        if touched:
            m.recompile()
    return n


def strip_residuals(ep, ops=None):
    """A program whose training-form ``Name_fwd`` calls (chosen by ``ops``,
    default all) are ``Name`` calls: the residual outputs, which only a backward
    would use, are dropped. A ``Name_fwd`` call whose residuals are used is an
    error (the program is a training graph)."""
    _check_program(ep)
    nodes = _all_opaque(ep.graph_module)
    chosen = _chooser(ops, nodes)
    gm = copy.deepcopy(ep.graph_module)
    _strip(gm, chosen, strict=True)
    return _new_program(ep, gm)


def _run_decompositions(ep, table: dict, what: str):
    gm = copy.deepcopy(ep.graph_module)
    if _prune_dead_residuals(gm):
        ep = _new_program(ep, gm)
    try:
        return ep.run_decompositions(table)
    except Exception as e:
        raise RuntimeError(
            f"torch_opaque.passes.{what}: retracing the program failed: {type(e).__name__}: {e}"
        ) from e


def inline(ep, ops=None):
    """A program in which the chosen opaque calls (default: all, also those that
    appear when inlined forwards call other opaque ops) are replaced by their
    forward (``Name``, ``Name_fwd``) or backward (``Name_bwd``) traced to ATen ops."""
    _check_program(ep)
    nodes = _all_opaque(ep.graph_module)
    chosen = _chooser(ops, nodes)
    for _round in range(16):
        table = {}
        for _node, info in nodes:
            if chosen(info) and info.target not in table:
                table[info.target] = _decomposition(info)
        if not table:
            return ep
        ep = _run_decompositions(ep, table, "inline")
        nodes = _all_opaque(ep.graph_module)
        if ops is not None:
            return ep
    raise RuntimeError("torch_opaque.passes.inline: opaque forwards call each other without end")


def _as_callable(fn) -> Callable:
    if isinstance(fn, OpaqueFunction):
        return fn.cls.apply
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        return fn.apply
    if callable(fn):
        return fn
    raise TypeError(
        f"torch_opaque.passes.replace: the replacement must be a function, an op or an "
        f"autograd.Function class, got {type(fn).__name__}."
    )


def replace(ep, op, fn):
    """A program in which every call of opaque op ``op`` runs ``fn`` instead.

    ``fn`` takes the arguments the Function's forward takes (without ctx) and
    returns what it returns (a tensor or a tuple of tensors); it may be a
    Python function, an operator (``torch.ops.aten.sin.default``), or another
    autograd.Function class (its ``apply``; a wrapped one stays an opaque op).
    Training-form calls (``Name_fwd``) are first turned into ``Name`` calls when
    their residuals are unused; a program that also calls ``Name_bwd`` is
    refused.
    """
    _check_program(ep)
    call = _as_callable(fn)
    nodes = _all_opaque(ep.graph_module)
    chosen = _chooser(op, nodes)
    for node, info in nodes:
        if chosen(info) and info.role == "bwd":
            raise ValueError(
                f"torch_opaque.passes.replace: the program calls {info.qualified_name}_bwd "
                f"(node '{node.name}'), the op's backward, which a forward replacement cannot "
                f"stand in for; use inline() or strip the training form first."
            )
    if any(chosen(i) and i.role == "fwd" for _, i in nodes):
        gm = copy.deepcopy(ep.graph_module)
        _strip(gm, chosen, strict=True)
        ep = _new_program(ep, gm)
        nodes = _all_opaque(ep.graph_module)
    table = {}
    for _node, info in nodes:
        if chosen(info) and info.target not in table:
            table[info.target] = _replacement(info, call, fn)
    return _run_decompositions(ep, table, "replace")


def _replacement(info: OpaqueInfo, call: Callable, original: Any) -> Callable:
    schema = info.target._schema
    n_out = len(schema.returns)
    py_ov = info.python_overload
    convs = [(i, s.convert) for i, s in enumerate(py_ov.specs) if s.convert] if py_ov else []
    qual = f"{info.qualified_name}.{info.overload}"

    def replacement(*args, **kwargs):
        args = full_args(schema, args, kwargs)
        for i, conv in convs:
            if args[i] is not None:
                args[i] = conv(args[i])
        out = call(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != n_out or not all(isinstance(o, torch.Tensor) for o in outs):
            raise RuntimeError(
                f"torch_opaque.passes.replace: {original!r} returned "
                f"{type(out).__name__} with {len(outs)} item(s) for {qual}, which returns "
                f"{n_out} tensor(s)."
            )
        inputs = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))]
        outs = unalias(outs, inputs)
        return outs[0] if n_out == 1 else outs

    return replacement
