"""Self-contained archives, save side: each kind of opaque call traced to ATen
with torch.export and described by a :class:`~.manifest.VariantRecord`
(Note [Self-contained archives] in torch_opaque/archive/__init__.py).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from typing import Optional

import torch

from .._impl.bridge import SavedKind, saved_triples
from .._impl.kernels import BackwardRunner, Runner
from .._impl.tracing import size_hint
from ..errors import ArchiveError
from .optional_outputs import optional_tensor_list_results
from .manifest import PROGRAM_PREFIX, SAVED_KIND_NAMES, ArgRecord, SavedRecord, TensorSig, VariantRecord
from .._impl.calls import full_args, tensor_kind
from .values import decode_value, dtype_name, encode_value, normalize_value


# ---- self-contained: tracing each kind of call ---------------------------------------


def _is_symbolic(v) -> bool:
    return isinstance(v, torch.SymInt) and not isinstance(v.node.maybe_as_int(), int)


def _val(a):
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


class _ForwardTrace(torch.nn.Module):
    """The user's forward, as a module torch.export can trace: (flat tensors and
    symbolic ints) -> (outputs, residuals, state ints)."""

    def __init__(self, fn, overload, desc, report):
        super().__init__()
        ov = fn.overloads[overload]
        setup = fn.cls.setup_context if fn.setup_style else None
        self.runner = Runner(fn.display_name, fn.cls.forward, setup, ov.specs, ov.n_out)
        self.fn_name = fn.display_name
        self.desc = desc
        # torch.export restores state reachable from the module after tracing:
        # the record goes to a list the module does not reference.
        self._report = report

    def forward(self, flat):
        args = _rebuild_args(self.desc, list(flat))
        needs = tuple(
            d["kind"] == "tensor" and args[i] is not None for i, d in enumerate(self.desc)
        )
        # The C++ run copies outputs and residuals that alias inputs (Note [One
        # forward finisher]); grad mode is left alone, as tracing requires.
        outs, residuals, record = self.runner.run(needs, args)
        saved, non_diff, _materialize, state, state_ints = record
        self._report((list(saved), list(non_diff), state, len(state_ints)))
        return (*outs, *residuals, *state_ints)


class _BackwardTrace(torch.nn.Module):
    """The user's backward: (saved tensors, output grads, state ints) -> grads."""

    def __init__(self, fn, overload, saved_none, n_out, state, needs, report):
        super().__init__()
        ov = fn.overloads[overload]
        self.runner = BackwardRunner(fn.display_name, fn.cls.backward, ov.specs)
        self.saved_none = saved_none
        self.n_out = n_out
        self.state = state
        self.needs = needs
        self._report = report  # the positions of non-None gradients (see _ForwardTrace)

    def forward(self, flat):
        flat = list(flat)
        saved = []
        for is_none in self.saved_none:
            saved.append(None if is_none else flat.pop(0))
        grads = flat[: self.n_out]
        ints = flat[self.n_out :]
        (res,) = self.runner(saved, grads, self.needs, self.state, ints)
        positions = [i for i, g in enumerate(res) if g is not None]
        self._report(positions)
        return tuple(res[i] for i in positions)


def _rebuild_args(desc, flat: list) -> list:
    """Operator arguments from a variant description and its flat program inputs."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    ints = [x for x in flat if not isinstance(x, torch.Tensor)]
    args = []
    for d in desc:
        k = d["kind"]
        if k == "none":
            args.append(None)
        elif k == "tensor":
            args.append(tensors.pop(0))
        elif k == "tensors":
            args.append([tensors.pop(0) for _ in d["items"]])
        elif k == "dyn":
            args.append(ints.pop(0))
        else:
            args.append(decode_value(d["value"]))
    return args


def _program_bytes(prog) -> str:
    buf = io.BytesIO()
    with optional_tensor_list_results():
        torch.export.save(prog, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _export(module, flat, dyn, what: str):
    try:
        return torch.export.export(module, (flat,), dynamic_shapes=(dyn,), strict=False)
    except Exception as e:
        raise RuntimeError(f"torch.export of the {what} failed: {type(e).__name__}: {e}") from e


def _add_programs(variant: VariantRecord, payload: dict, files: dict, counter: list) -> None:
    for which in ("fwd", "bwd"):
        counter[0] += 1
        fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
        files[fname] = payload[which]
        setattr(variant, which, fname)


def store_overload(rec, overload: str, files: dict, counter: list, fn, stored) -> tuple:
    """(manifest variants, traced programs) for every kind of call of one
    overload. ``fn``: its OpaqueFunction (or None); ``stored``: its
    stored.StoredOverload when it was itself loaded from a self-contained archive."""
    if stored is not None:
        # Re-saving a program loaded from a self-contained archive: keep its programs.
        variants = []
        for v in stored.variants:
            record = dataclasses.replace(v.record)
            _add_programs(record, v.payload, files, counter)
            variants.append(record)
        return variants, [m for v in stored.variants for m in (v.fwd, v.bwd) if m is not None]

    qual = f"{rec.qualified_name}.{overload}"
    if fn is None or overload not in fn.overloads:
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): {qual} has no Python forward/backward "
            f"to trace (it is defined in C++); save without self_contained=True and load the "
            f"library that defines it before torch_opaque.load."
        )
    info = rec.overloads[overload]
    schema = rec.overload_packet(overload)._schema
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
        try:
            entry, fwd_prog, bwd_prog = _trace_variant(fn, overload, schema, desc, flat, dyn)
        except Exception as e:
            raise ArchiveError(
                f"torch_opaque.save(self_contained=True): cannot trace {qual} "
                f"({fn.cls.__module__}.{fn.cls.__qualname__}) to ATen for the call at node "
                f"'{node.name}': {e}. Save without self_contained=True (loading then imports "
                f"the defining module), or make forward/backward traceable."
            ) from e
        entry.id = len(variants)
        payload = {"fwd": _program_bytes(fwd_prog), "bwd": _program_bytes(bwd_prog)}
        _add_programs(entry, payload, files, counter)
        variants.append(entry)
        programs += [fwd_prog.graph_module, bwd_prog.graph_module]
    return variants, programs


def _meta_dims(val) -> Optional[dict]:
    if isinstance(val, torch.Tensor):
        return _dims(val)
    if _is_symbolic(val):
        return torch.export.Dim.AUTO
    return None


def _trace_variant(fn, overload, schema, desc, flat, dyn) -> tuple:
    n_out = fn.overloads[overload].n_out
    records: list = []
    fwd_mod = _ForwardTrace(fn, overload, desc, lambda r: records.append(r))
    fwd_prog = _export(fwd_mod, flat, dyn, "forward")
    saved, non_diff, state, n_ints = records[-1]
    with torch.no_grad():
        res = list(fwd_prog.module()(flat))
    n_res = len(res) - n_out - n_ints
    outs, residuals, ints = res[:n_out], res[n_out : n_out + n_res], res[n_out + n_res :]

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
    args = _rebuild_args(desc, list(flat))

    b_flat, b_dyn, saved_none = [], [], []
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
        b_flat.append(t)
        b_dyn.append(_meta_dims(meta))
    for k, o in enumerate(outs):
        if o.dtype.is_floating_point or o.dtype.is_complex:
            b_flat.append(torch.randn_like(o))
        else:
            b_flat.append(torch.zeros_like(o))
        b_dyn.append(_meta_dims(out_vals[k]))
    for k, v in enumerate(ints):
        b_flat.append(int(v))
        b_dyn.append(_meta_dims(out_vals[n_out + n_res + k]))
    needs = [d["kind"] == "tensor" for d in desc]
    box: list = []
    bwd_mod = _BackwardTrace(fn, overload, saved_none, n_out, state, needs, box.append)
    bwd_prog = _export(bwd_mod, b_flat, b_dyn, "backward")
    if not box or any(p != box[0] for p in box):
        raise RuntimeError("the backward returns gradients for different inputs when traced")
    entry = VariantRecord(
        id=0,
        args=[_arg_record(d) for d in desc],
        n_residuals=n_res,
        n_state_ints=n_ints,
        saved=[SavedRecord(SAVED_KIND_NAMES[kind], i, j) for kind, i, j in saved_triples(saved)],
        non_differentiable=[bool(x) for x in non_diff],
        grads=list(box[-1]),
        fwd="",
        bwd="",
        state=state,
    )
    return entry, fwd_prog, bwd_prog


def _arg_record(d: dict) -> ArgRecord:
    if d["kind"] == "tensor":
        return ArgRecord("tensor", tensor=TensorSig(d["dtype"], d["shape"], d["device"]))
    if d["kind"] == "tensors":
        return ArgRecord("tensors", items=[TensorSig(**t) for t in d["items"]])
    if d["kind"] == "const":
        return ArgRecord("const", value=d["value"])
    return ArgRecord(d["kind"])


