"""Self-contained archives, save side: each kind of opaque call traced to ATen
with torch.export and described by a :class:`~.manifest.VariantRecord`
(Note [Self-contained archives] in torch_opaque/archive/__init__.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Optional

import torch

from .._impl.bridge import SavedKind, saved_triples
from .._impl.kernels import BackwardRunner, Runner
from .._impl.cpp_kernels import CppBackward, CppRunner
from .._impl.tracing import BackwardTrace, CallTemplate, ForwardTrace, size_hint, trace_to_aten
from ..errors import ArchiveError
from .readback import stored_program_bytes
from .optional_outputs import optional_tensor_list_results
from .manifest import (PROGRAM_PREFIX, SAVED_KIND_NAMES, ArgRecord, PartialBackward, SavedRecord,
                       TensorSig, VariantRecord)
from .._impl.calls import full_args, tensor_kind
from .values import decode_value, dtype_name, encode_value, normalize_value


# ---- self-contained: tracing each kind of call ---------------------------------------


def _is_symbolic(v) -> bool:
    return isinstance(v, torch.SymInt) and not isinstance(v.node.maybe_as_int(), int)


def _val(a):
    if isinstance(a, (list, tuple)):  # a Tensor[] argument: a list of nodes
        return type(a)(_val(x) for x in a)
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _tensor_sig(t) -> dict:
    return {
        "dtype": dtype_name(t.dtype),
        "shape": [None if _is_symbolic(s) else int(s) for s in t.shape],
        "device": str(t.device),
    }


def _site_signature(schema, node) -> tuple:
    """(variant args description, example flat inputs, dynamic_shapes) of one call."""
    values = [_val(a) for a in full_args(schema, node.args, node.kwargs)]
    desc, flat, dyn = [], [], []
    ints_flat, ints_dyn = [], []
    for arg, v in zip(schema.arguments, values):
        kind = tensor_kind(arg)
        if kind == "tensor" and v is None:
            desc.append({"kind": "none"})
        elif kind == "tensor":
            desc.append({"kind": "tensor", **_tensor_sig(v)})
            flat.append(_example_tensor(v))
            dyn.append(_dims(v))
        elif kind == "tensors":
            items = []
            for t in v:
                if t is None:
                    raise ValueError(f"argument '{arg.name}' holds None inside a tensor list")
                items.append(_tensor_sig(t))
                flat.append(_example_tensor(t))
                dyn.append(_dims(t))
            desc.append({"kind": "tensors", "items": items})
        elif isinstance(v, torch.SymInt) and _is_symbolic(v):
            desc.append({"kind": "dyn"})
            ints_flat.append(size_hint(v))
            ints_dyn.append(torch.export.Dim.AUTO)
        else:
            if isinstance(v, (torch.SymFloat, torch.SymBool)) or (
                isinstance(v, (list, tuple)) and any(_is_symbolic(x) for x in v)
            ):
                raise ValueError(
                    f"argument '{arg.name}' is symbolic ({v}); only tensors and single "
                    f"symbolic ints can vary in a stored program"
                )
            desc.append({"kind": "const", "value": encode_value(normalize_value(v, arg))})
    return desc, flat + ints_flat, dyn + ints_dyn


def _dims(t) -> Optional[dict]:
    d = {i: torch.export.Dim.AUTO for i, s in enumerate(t.shape) if _is_symbolic(s)}
    return d or None


def _example_tensor(t) -> torch.Tensor:
    shape = [size_hint(s) for s in t.shape]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        gen = torch.Generator().manual_seed(len(shape) * 7919 + sum(shape))
        return torch.randn(shape, dtype=t.dtype, generator=gen).to(t.device)
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _template(desc) -> CallTemplate:
    """The call template (Note [Tracing a call kind to ATen]) of a variant description."""
    slots = {"none": lambda d: ("N",), "tensor": lambda d: ("T",), "dyn": lambda d: ("I",),
             "tensors": lambda d: ("L", len(d["items"])),
             "const": lambda d: ("C", decode_value(d["value"]))}
    return CallTemplate([slots[d["kind"]](d) for d in desc])


def _export(module, flat, dyn, what: str):
    try:
        return trace_to_aten(module, flat, dyn)
    except Exception as e:
        if what == "backward" and _FAKE_CONSTANT in str(e):
            return _export_aten_ir(module, flat, dyn, e)
        raise RuntimeError(f"torch.export of the {what} failed: {type(e).__name__}: {e}") from e


# Note [Backwards traced to the ATen IR]
# torch.export's training IR keeps a grad-mode region (``with
# torch.enable_grad():`` inside a backward that grad mode off runs) as a
# higher-order op around its ops; a backward that builds an autograd graph in
# the region and calls torch.autograd.grad after it (the recompute pattern)
# then leaks fake tensors into the program's constants ("We found a fake
# tensor in the exported program constant's list"). Traced to the ATen IR
# (torch.export without pre-dispatch, as run_decompositions gives), grad mode
# takes effect while tracing and autograd.grad's ATen ops are recorded, so
# such a backward is traced that way; every other program keeps the training IR.
_FAKE_CONSTANT = "fake tensor in the exported program constant"


def _export_aten_ir(module, flat, dyn, first: Exception):
    from torch.export import _trace

    try:
        return _trace._export(module, (list(flat),), dynamic_shapes=(list(dyn),), strict=False,
                              pre_dispatch=False)
    except Exception as e:
        raise RuntimeError(
            f"torch.export of the backward failed: {type(first).__name__}: {first}; traced to "
            f"the ATen IR too: {type(e).__name__}: {e}"
        ) from e


def _add_programs(variant: VariantRecord, payload: dict, files: dict, counter: list) -> None:
    """Names the programs of ``payload`` (stored.variant_payload's shape) in
    ``files`` and in ``variant``."""

    def add(which: str, text: str) -> str:
        counter[0] += 1
        fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
        files[fname] = text
        return fname

    variant.fwd = add("fwd", payload["fwd"])
    variant.bwd = None if payload["bwd"] is None else add("bwd", payload["bwd"])
    variant.partial = [dataclasses.replace(p, bwd=add("bwd", text))
                       for p, text in zip(variant.partial, payload["partial"])]


def store_overload(rec, overload: str, files: dict, counter: list, fn, stored,
                   warn=None) -> tuple:
    """(manifest variants, traced programs) for every kind of call of one
    overload. ``fn``: its OpaqueFunction (None: an op defined in C++, whose
    kernels are traced); ``stored``: its
    stored.StoredOverload when it was itself loaded from a self-contained archive.
    ``warn(message)`` is told when a backward is left out (Note [Stored
    programs run in eager's state])."""
    if stored is not None:
        # Re-saving a program loaded from a self-contained archive: keep its programs.
        variants = []
        for v in stored.variants:
            record = dataclasses.replace(v.record)
            _add_programs(record, v.payload, files, counter)
            variants.append(record)
        return variants, [m for v in stored.variants for m in v.modules()]

    qual = f"{rec.qualified_name}.{overload}"
    if fn is not None and overload not in fn.overloads:
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): {qual} is not an overload of "
            f"{fn.display_name}, so there is no forward/backward to trace; save without "
            f"self_contained=True."
        )
    kernels = _python_kernels(fn, overload) if fn is not None else _cpp_kernels(rec, overload)
    info = rec.overloads[overload]
    schema = rec.overload_packet(overload)._schema
    # a training program calls the stored backward: it must be stored
    trains = any(site.role == "fwd" for _, site in info["sites"])
    seen: dict = {}
    variants, programs = [], []
    for node, site in info["sites"]:
        if site.role == "bwd":
            # a training program's backward: it runs the stored backward of the
            # variant of its forward call (Note [Stored backward of training programs])
            continue
        try:
            desc, flat, dyn = _site_signature(schema, node)
        except (ValueError, TypeError) as e:
            raise ArchiveError(
                f"torch_opaque.save(self_contained=True): cannot store {qual} (called at node "
                f"'{node.name}'): {e}."
            ) from e
        key = json.dumps(desc, sort_keys=True)
        if key in seen:
            continue
        seen[key] = True
        bwd_programs = []
        try:
            entry, fwd_prog, bwd_programs = _trace_variant(*kernels, desc, flat, dyn)
        except BackwardNotTraced as e:
            if fn is None or trains:
                _raise_untraceable(qual, fn, node, e.__cause__ or e)
            entry, fwd_prog = e.entry, e.fwd_prog
            entry.bwd_error = (
                f"the backward of {qual} ({fn.cls.__module__}.{fn.cls.__qualname__}) could not "
                f"be traced when the program was saved ({e.reason})"
            )
            if warn is not None:
                warn(
                    f"torch_opaque.save(self_contained=True): the backward of {qual} "
                    f"({fn.cls.__module__}.{fn.cls.__qualname__}) cannot be traced ({e.reason}); "
                    f"the archive stores its forward only. The loaded program runs for inference; "
                    f"calling its backward raises this reason."
                )
        except Exception as e:
            _raise_untraceable(qual, fn, node, e)
        entry.id = len(variants)
        # (each read back as load reads it: Note [Saving reads back what it wrote])
        what = lambda which: f"the stored {which} program of {qual}"  # noqa: E731
        payload = {"fwd": stored_program_bytes(fwd_prog, what("fwd")), "bwd": None,
                   "partial": []}
        for pattern, prog in bwd_programs:
            if pattern is None:
                # Note [A backward with no gradients]: a backward that returns None for
                # every input (a straight-through blocker, a list argument without a
                # gradient) traces to a program with no outputs, which torch's
                # serializer cannot write; none is stored, and the manifest's empty
                # `grads` says the loaded backward returns no gradient (stored.py).
                if entry.grads:
                    payload["bwd"] = stored_program_bytes(prog, what("bwd"))
            else:
                payload["partial"].append(stored_program_bytes(prog, what("partial bwd")))
        _add_programs(entry, payload, files, counter)
        variants.append(entry)
        programs += [fwd_prog.graph_module] + [p.graph_module for _, p in bwd_programs]
    return variants, programs


def _raise_untraceable(qual: str, fn, node, e: BaseException):
    if fn is None:
        cause = (str(e).strip().splitlines() or [""])[0].rstrip(".")
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): cannot trace {qual} (defined in "
            f"C++) to ATen for the call at node '{node.name}': {cause}. Its forward and "
            f"backward kernels are stored only when they are made of ATen ops (not "
            f"loops over data_ptr, say). Save without self_contained=True and call "
            f"torch_opaque.load_library(<the library that defines it>) before "
            f"torch_opaque.load."
        ) from e
    raise ArchiveError(
        f"torch_opaque.save(self_contained=True): cannot trace {qual} "
        f"({fn.cls.__module__}.{fn.cls.__qualname__}) to ATen for the call at node "
        f"'{node.name}': {e}. Save without self_contained=True (loading then imports "
        f"the defining module), or make forward/backward traceable."
    ) from e


def _meta_dims(val) -> Optional[dict]:
    if isinstance(val, torch.Tensor):
        return _dims(val)
    if _is_symbolic(val):
        return torch.export.Dim.AUTO
    return None


def _python_kernels(fn, overload) -> tuple:
    """(forward runner, backward, n_out) of a Python Function's overload."""
    ov = fn.overloads[overload]
    setup = fn.cls.setup_context if fn.setup_style else None
    runner = Runner(fn.display_name, fn.cls.forward, setup, ov.specs, ov.n_out)
    backward = BackwardRunner(fn.display_name, fn.cls.backward, ov.specs)
    return runner, lambda *a: backward(*a)[0], ov.n_out


def _cpp_kernels(rec, overload) -> tuple:
    """(forward runner, backward, n_out) of an op defined in C++: its own kernels
    run below autograd (Note [Kernels below autograd])."""
    qual = f"{rec.qualified_name}.{overload}"
    schema = rec.overload_packet(overload)._schema
    lists = [a.name for a in schema.arguments if tensor_kind(a) == "tensors"]
    if lists or any(not isinstance(r.type, torch.TensorType) for r in schema.returns):
        what = f"Tensor[] argument '{lists[0]}'" if lists else "Tensor[] result"
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): {qual} (defined in C++) has a {what}; "
            f"C++ ops are stored self-contained only with Tensor arguments and results. Save "
            f"without self_contained=True and call torch_opaque.load_library(<the library "
            f"that defines it>) before torch_opaque.load."
        )
    runner = CppRunner(rec.namespace, rec.name, overload)
    return runner, CppBackward(rec.namespace, rec.name, overload), runner.n_out


# Note [Stored programs run in eager's state]
# Eager autograd runs a Function's forward with grad mode off, on inputs that
# keep their requires_grad, and its backward with grad mode off (unless
# backward(create_graph=True)), on saved tensors that require grad as the
# forward's inputs and outputs do, with ctx.needs_input_grad as at the call and
# None for undefined output gradients when the forward called
# ctx.set_materialize_grads(False). Python in forward and backward reads that
# state (a learnable clip bound gets a gradient only `if alpha.requires_grad`,
# a backward refuses grad mode, a recompute runs under enable_grad), so each
# stored program is traced in it:
# * both are traced under torch.no_grad(); a grad-mode region inside
#   (enable_grad around a recompute and autograd.grad) is traced as a region;
# * a stored program serves every later call of its kind, so it is traced for
#   the most demanding one: each floating-point Tensor argument requires grad
#   (needs_input_grad True there); saved inputs and differentiable saved
#   outputs require grad, other saved tensors and output gradients do not. The
#   loaded backward keeps the gradients ctx.needs_input_grad asks for;
# * materialize-grads off (VariantRecord.materialize False): one more backward
#   program per pattern of undefined output gradients (PartialBackward, for up
#   to MAX_PARTIAL_OUTPUTS outputs), each traced with None in those places.
# A backward that cannot be traced does not stop an inference program from
# being saved (the call is not in a training program): the variant stores the
# forward and why the backward is missing (bwd_error), save warns once per
# op, and the loaded op raises that reason if its backward is ever called.
# Limits (docs/limits.md): backward(create_graph=True) runs the program traced
# with grad mode off (its ATen ops are differentiated), so a backward that
# branches on grad mode runs its grad-off branch.

MAX_PARTIAL_OUTPUTS = 4


class BackwardNotTraced(Exception):
    """The forward of a kind of call traced, its backward did not; ``entry`` and
    ``fwd_prog`` are the forward's, ``reason`` says why."""

    def __init__(self, entry, fwd_prog, reason: str):
        super().__init__(reason)
        self.entry, self.fwd_prog, self.reason = entry, fwd_prog, reason


def _differentiable(t) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _flags(flat) -> list:
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in flat]


def _plain(flat) -> list:
    """The traced inputs themselves require no grad (tracing.requiring_grad)."""
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]


def _as_at_call(desc, flat) -> list:
    """``flat`` with each floating-point Tensor argument requiring grad (Note
    [Stored programs run in eager's state]); tensor-list items as given."""
    out, pos = list(flat), 0
    for d in desc:
        if d["kind"] == "tensor":
            if _differentiable(out[pos]):
                out[pos] = out[pos].detach().requires_grad_()
            pos += 1
        elif d["kind"] == "tensors":
            pos += len(d["items"])
    return out


def _trace_variant(runner, backward, n_out, desc, flat, dyn) -> tuple:
    """(VariantRecord, forward program, backward programs: (None or the
    defined-gradient pattern, program) pairs). Raises BackwardNotTraced when
    only the forward traced."""
    template = _template(desc)
    flat = _as_at_call(desc, flat)
    tensors = iter([t for t in flat if isinstance(t, torch.Tensor)])
    needs = []
    for d in desc:
        if d["kind"] == "tensor":
            needs.append(next(tensors).requires_grad)
        else:
            needs.append(False)
            for _ in d.get("items", ()):
                next(tensors)
    records: list = []
    fwd_mod = ForwardTrace(runner, template, needs, records.append, state_ints=True,
                           requires_grad=_flags(flat))
    with torch.no_grad():
        fwd_prog = _export(fwd_mod, _plain(flat), dyn, "forward")
    saved, non_diff, materialize, state, state_ints = records[-1]
    n_ints = len(state_ints)
    with torch.no_grad():
        res = list(fwd_prog.module()(_plain(flat)))
    n_res = len(res) - n_out - n_ints
    outs, residuals, ints = res[:n_out], res[n_out : n_out + n_res], res[n_out + n_res :]
    nd_out = [bool(x) for x in non_diff] + [False] * (n_out - len(non_diff))
    outs = [o.detach().requires_grad_() if _differentiable(o) and not nd else o
            for o, nd in zip(outs, nd_out)]

    # which flat program input / output holds each value (for dynamic dims)
    placeholders = [n for n in fwd_prog.graph.nodes if n.op == "placeholder"]
    user_inputs = [
        n for n in placeholders if n.name in set(fwd_prog.graph_signature.user_inputs)
    ]
    out_node = next(n for n in fwd_prog.graph.nodes if n.op == "output")
    out_vals = [_val(a) for a in out_node.args[0]]
    in_vals = [_val(n) for n in user_inputs]
    flat_pos = {}
    pos = 0
    for i, d in enumerate(desc):
        if d["kind"] == "tensor":
            flat_pos[(i, 0)] = pos
            pos += 1
        elif d["kind"] == "tensors":
            for j in range(len(d["items"])):
                flat_pos[(i, j)] = pos
                pos += 1
    args = template.rebuild(list(flat))

    saved_flat, saved_dyn, saved_none = [], [], []
    for kind, index, item in saved_triples(saved):
        if kind is SavedKind.NONE:
            saved_none.append(True)
            continue
        if kind is SavedKind.INPUT:
            t, meta = args[index], in_vals[flat_pos[(index, 0)]]
        elif kind is SavedKind.INPUT_LIST_ITEM:
            t, meta = args[index][item], in_vals[flat_pos[(index, item)]]
        elif kind is SavedKind.OUTPUT:
            t, meta = outs[index], out_vals[index]
        else:
            t, meta = residuals[index], out_vals[n_out + index]
        if t is None:
            saved_none.append(True)
            continue
        saved_none.append(False)
        saved_flat.append(t)
        saved_dyn.append(_meta_dims(meta))
    grads = []
    for k, o in enumerate(outs):
        g = torch.randn_like(o, requires_grad=False) if _differentiable(o) else torch.zeros_like(o)
        grads.append((g.detach(), _meta_dims(out_vals[k])))
    int_flat = [int(v) for v in ints]
    int_dyn = [_meta_dims(out_vals[n_out + n_res + k]) for k in range(n_ints)]

    def trace_backward(defined) -> tuple:
        box: list = []
        given = [g for g, d in zip(grads, defined) if d]
        grad_slot = ("L", n_out) if all(defined) else ("O", tuple(not d for d in defined))
        bwd_template = CallTemplate([("O", saved_none), grad_slot, ("C", needs), ("C", state),
                                     ("IL", n_ints)])
        b_flat = saved_flat + [g for g, _ in given] + int_flat
        b_dyn = saved_dyn + [d for _, d in given] + int_dyn
        bwd_mod = BackwardTrace(backward, bwd_template, report=box.append,
                                requires_grad=_flags(b_flat))
        with torch.no_grad():
            prog = _export(bwd_mod, _plain(b_flat), b_dyn, "backward")
        if not box or any(p != box[0] for p in box):
            raise RuntimeError("the backward returns gradients for different inputs when traced")
        return list(box[-1]), prog

    entry = VariantRecord(
        id=0,
        args=[_arg_record(d) for d in desc],
        n_residuals=n_res,
        n_state_ints=n_ints,
        saved=[SavedRecord(SAVED_KIND_NAMES[kind], i, j) for kind, i, j in saved_triples(saved)],
        non_differentiable=[bool(x) for x in non_diff],
        grads=[],
        fwd="",
        bwd=None,
        state=state,
        materialize=bool(materialize),
    )
    try:
        entry.grads, bwd_prog = trace_backward((True,) * n_out)
    except Exception as e:
        raise BackwardNotTraced(entry, fwd_prog, _first_line(e)) from e
    programs = [(None, bwd_prog)]
    if not materialize and n_out <= MAX_PARTIAL_OUTPUTS:
        for pattern in itertools.product((True, False), repeat=n_out):
            if all(pattern) or not any(pattern):
                continue
            try:
                positions, prog = trace_backward(pattern)
            except Exception:  # eager fails there too; the loaded op says it is not stored
                continue
            entry.partial.append(PartialBackward(list(pattern), positions, ""))
            programs.append((pattern, prog))
    return entry, fwd_prog, programs


def _first_line(e: BaseException) -> str:
    cause = e.__cause__ if e.__cause__ is not None else e
    text = (str(cause).strip().splitlines() or [""])[0].rstrip(".")
    return f"{type(cause).__name__}: {text}"[:1000]


def _arg_record(d: dict) -> ArgRecord:
    if d["kind"] == "tensor":
        return ArgRecord("tensor", tensor=TensorSig(d["dtype"], d["shape"], d["device"]))
    if d["kind"] == "tensors":
        return ArgRecord("tensors", items=[TensorSig(**t) for t in d["items"]])
    if d["kind"] == "const":
        return ArgRecord("const", value=d["value"])
    return ArgRecord(d["kind"])


