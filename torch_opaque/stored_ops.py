"""Self-contained archives: each kind of opaque call traced to ATen, stored in the
archive, and re-created as a working op in a process without the user's code
(see Note [Self-contained archives] in torch_opaque/archive.py).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Optional

import torch

from . import _C
from .archive_format import (
    PROGRAM_PREFIX,
    ArchiveError,
    _decode_value,
    _encode_value,
    _full_args,
    _normalize_value,
    _op_overload,
    _OpRecord,
    _schema_or_none,
    _tensor_kind,
)



# ---- self-contained: tracing each kind of call ---------------------------------------


def _hint(v) -> int:
    if isinstance(v, int):
        return v
    node = v.node
    h = getattr(node, "hint", None)
    if h is not None:
        return int(h)
    env = getattr(node, "shape_env", None)
    if env is not None:
        try:
            h = env.size_hint(node.expr, allow_none=True)
        except Exception:
            h = None
        if h is not None:
            return int(h)
        subs = {}
        for s in node.expr.free_symbols:
            vr = env.var_to_range.get(s)
            lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 2
            subs[s] = max(lo, 2)
        try:
            return int(node.expr.xreplace(subs))
        except Exception:
            pass
    return 4


def _is_symbolic(v) -> bool:
    return isinstance(v, torch.SymInt) and not isinstance(v.node.maybe_as_int(), int)


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _tensor_sig(t) -> dict:
    return {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": [None if _is_symbolic(s) else int(s) for s in t.shape],
        "device": str(t.device),
    }


def _site_signature(schema, node) -> tuple:
    """(variant args description, example flat inputs, dynamic_shapes) of one call."""
    values = [_val(a) for a in _full_args(schema, node.args, node.kwargs)]
    desc, flat, dyn = [], [], []
    ints_flat, ints_dyn = [], []
    for arg, v in zip(schema.arguments, values):
        kind = _tensor_kind(arg)
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
            ints_flat.append(_hint(v))
            ints_dyn.append(torch.export.Dim.AUTO)
        else:
            if isinstance(v, (torch.SymFloat, torch.SymBool)) or (
                isinstance(v, (list, tuple)) and any(_is_symbolic(x) for x in v)
            ):
                raise ValueError(
                    f"argument '{arg.name}' is symbolic ({v}); only tensors and single "
                    f"symbolic ints can vary in a stored program"
                )
            desc.append({"kind": "const", "value": _encode_value(_normalize_value(v, arg))})
    return desc, flat + ints_flat, dyn + ints_dyn


def _dims(t) -> Optional[dict]:
    d = {i: torch.export.Dim.AUTO for i, s in enumerate(t.shape) if _is_symbolic(s)}
    return d or None


def _example_tensor(t) -> torch.Tensor:
    shape = [_hint(s) for s in t.shape]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        gen = torch.Generator().manual_seed(len(shape) * 7919 + sum(shape))
        return torch.randn(shape, dtype=t.dtype, generator=gen).to(t.device)
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


class _ForwardTrace(torch.nn.Module):
    """The user's forward, as a module torch.export can trace: (flat tensors and
    symbolic ints) -> (outputs, residuals, state ints)."""

    def __init__(self, fn, overload, desc, report):
        super().__init__()
        from .kernels import Runner

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
        from .kernels import BackwardRunner

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
            args.append(_decode_value(d["value"]))
    return args


def _program_bytes(prog) -> str:
    buf = io.BytesIO()
    torch.export.save(prog, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _export(module, flat, dyn, what: str):
    try:
        return torch.export.export(module, (flat,), dynamic_shapes=(dyn,), strict=False)
    except Exception as e:
        raise RuntimeError(f"torch.export of the {what} failed: {type(e).__name__}: {e}") from e


def _store_overload(rec: _OpRecord, overload: str, files: dict, counter: list) -> tuple:
    """(manifest variants, traced programs) for every kind of call of one overload."""
    stored = _STORED.get((rec.namespace, rec.name))
    if stored is not None and overload in stored.overloads:
        # Re-saving a program loaded from a self-contained archive: keep its programs.
        sov = stored.overloads[overload]
        variants = []
        for v in sov.variants:
            entry = dict(v.entry)
            for which in ("fwd", "bwd"):
                counter[0] += 1
                fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
                files[fname] = v.payload[which]
                entry[which] = fname
            variants.append(entry)
        return variants, []

    from .function import _BY_OPNAME

    fn = rec.function or _BY_OPNAME.get((rec.namespace, rec.name))
    qual = f"{rec.qualified_name}.{overload}"
    if fn is None or overload not in fn.overloads:
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): {qual} has no Python forward/backward "
            f"to trace (it is defined in C++); save without self_contained=True and load the "
            f"library that defines it before torch_opaque.load."
        )
    info = rec.overloads[overload]
    if info["calls"]["bwd"] or any(i.role == "bwd" for _, i in info["sites"]):
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): the program calls {rec.qualified_name}_bwd "
            f"(a training graph's backward); stored programs can only replace the forward "
            f"forms {rec.qualified_name} and {rec.qualified_name}_fwd."
        )
    schema = _op_overload(rec.namespace, rec.name, overload)._schema
    seen: dict = {}
    variants, programs = [], []
    for node, _info in info["sites"]:
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
        entry["id"] = len(variants)
        for which, prog in (("fwd", fwd_prog), ("bwd", bwd_prog)):
            counter[0] += 1
            fname = f"{PROGRAM_PREFIX}{counter[0]}.{which}"
            files[fname] = _program_bytes(prog)
            entry[which] = fname
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
    for k in range(0, len(saved), 3):
        kind, index, item = saved[k : k + 3]
        if kind == 0:
            saved_none.append(True)
            continue
        if kind == 1:
            t, meta = args[index], in_vals[flat_pos[(index, 0)]]
        elif kind == 2:
            t, meta = args[index][item], in_vals[flat_pos[(index, item)]]
        elif kind == 3:
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
    entry = {
        "args": desc,
        "n_residuals": n_res,
        "n_state_ints": n_ints,
        "saved": saved,
        "non_differentiable": non_diff,
        "grads": box[-1],
    }
    return entry, fwd_prog, bwd_prog


# ---- load: re-creating ops from stored programs ---------------------------------------


class _Variant:
    def __init__(self, entry: dict, payload: dict, schema):
        self.entry = entry
        self.payload = payload  # "fwd"/"bwd" -> base64 text (kept for re-saving)
        self.id = entry["id"]
        self.args = entry["args"]
        self.n_res = entry["n_residuals"]
        self.n_ints = entry["n_state_ints"]
        self.saved = [int(x) for x in entry["saved"]]
        self.saved_none = [self.saved[k] == 0 for k in range(0, len(self.saved), 3)]
        self.non_diff = [bool(x) for x in entry["non_differentiable"]]
        self.grads = [int(x) for x in entry["grads"]]
        self.schema = schema
        self.fwd = None
        self.bwd = None

    def deserialize(self, description: str, qual: str) -> None:
        for which in ("fwd", "bwd"):
            try:
                prog = torch.export.load(io.BytesIO(base64.b64decode(self.payload[which])))
                setattr(self, which, prog.module())
            except Exception as e:
                raise ArchiveError(
                    f"torch_opaque.load: the stored {which} program of {qual} in {description} "
                    f"cannot be read ({type(e).__name__}: {e}); the archive is corrupted."
                ) from e

    def match(self, args, fake: bool) -> Optional[list]:
        """The flat program inputs for this call, or None when not covered."""
        if len(args) != len(self.args):
            return None
        tensors, ints = [], []
        for d, v, arg in zip(self.args, args, self.schema.arguments):
            k = d["kind"]
            if k == "none":
                if v is not None:
                    return None
            elif k == "tensor":
                if not _tensor_matches(d, v, fake):
                    return None
                tensors.append(v)
            elif k == "tensors":
                if v is None or len(v) != len(d["items"]):
                    return None
                for item, t in zip(d["items"], v):
                    if not _tensor_matches(item, t, fake):
                        return None
                    tensors.append(t)
            elif k == "dyn":
                if not isinstance(v, (int, torch.SymInt)):
                    return None
                ints.append(v)
            else:
                try:
                    if _encode_value(_normalize_value(v, arg)) != d["value"]:
                        return None
                except TypeError:
                    return None
        return tensors + ints


def _tensor_matches(d: dict, t, fake: bool) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if str(t.dtype).replace("torch.", "") != d["dtype"] or t.dim() != len(d["shape"]):
        return False
    if fake:
        return True
    return all(s is None or s == n for s, n in zip(d["shape"], t.shape))


def _covered(variants) -> str:
    lines = []
    for v in variants:
        parts = []
        for d, a in zip(v.args, v.schema.arguments):
            k = d["kind"]
            if k == "tensor":
                shape = ", ".join("*" if s is None else str(s) for s in d["shape"])
                parts.append(f"{a.name}: {d['dtype']}[{shape}]")
            elif k == "tensors":
                parts.append(f"{a.name}: {len(d['items'])} tensors")
            elif k == "const":
                parts.append(f"{a.name}={_decode_value(d['value'])!r}")
            elif k == "none":
                parts.append(f"{a.name}=None")
            else:
                parts.append(f"{a.name}: any int")
        lines.append("(" + ", ".join(parts) + ")")
    return "; ".join(lines)


def _call_summary(schema, args) -> str:
    parts = []
    for a, v in zip(schema.arguments, args):
        if isinstance(v, torch.Tensor):
            parts.append(f"{a.name}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}")
        else:
            parts.append(f"{a.name}={v!r}")
    return "(" + ", ".join(parts) + ")"


def _unalias(outs: tuple, inputs: list) -> tuple:
    """Operator outputs may not alias inputs or each other: copy those that do
    (what the C++ finishers do for Python Functions, here for stored programs)."""
    fixed = None
    for k, o in enumerate(outs):
        if o is None:
            continue
        if any(torch._C._is_alias_of(o, x) for x in inputs) or any(
            x is not None and torch._C._is_alias_of(o, x) for x in outs[:k]
        ):
            if fixed is None:
                fixed = list(outs)
            fixed[k] = o.clone()
    return outs if fixed is None else tuple(fixed)


class _StoredOverload:
    """Kernels of one overload re-created from stored programs."""

    def __init__(self, qual: str, overload: str, schema, n_out: int, variants: list):
        self.qual = qual
        self.overload = overload
        self.schema = schema
        self.n_out = n_out
        self.variants = variants

    def select(self, args, fake: bool):
        for v in self.variants:
            flat = v.match(args, fake)
            if flat is not None:
                return v, flat
        raise RuntimeError(
            f"torch_opaque: {self.qual}.{self.overload} was re-created from the stored programs "
            f"of a self-contained archive, which cover the calls {_covered(self.variants)}; "
            f"this call {_call_summary(self.schema, args)} is not one of them. Load the archive "
            f"with allow=[<defining module>] to run the original Function."
        )

    def split(self, v: _Variant, res):
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        n = self.n_out
        return res[:n], res[n : n + v.n_res], res[n + v.n_res :]

    # real kernels: the C++ bridge runs them like a Function's (Note [Python kernels]
    # in csrc/python/python_kernel.h), through _StoredRunner / _StoredBackwardRunner.
    def forward(self, ctx, *args):
        v, flat = self.select(args, fake=False)
        outs, residuals, ints = self.split(v, v.fwd(flat))
        # v.saved: (kind, index, item) triples as in include/torch_opaque/forward_record.h
        sources = {1: lambda i, j: args[i], 2: lambda i, j: args[i][j],
                   3: lambda i, j: outs[i], 4: lambda i, j: residuals[i]}  # fmt: skip
        spec = list(v.saved)
        saved = [
            sources[spec[k]](spec[k + 1], spec[k + 2]) if spec[k] else None
            for k in range(0, len(spec), 3)
        ]
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*(o for o, nd in zip(outs, v.non_diff) if nd))
        ctx.stored_state = (str(v.id), list(ints))  # read by _StoredRunner.encode_ctx
        return tuple(outs)

    def backward(self, ctx, *grads):
        v = ctx.variant
        flat = [t for t, none in zip(ctx.saved_tensors, v.saved_none) if not none]
        if any(g is None for g in grads):
            raise RuntimeError(
                f"torch_opaque: {self.qual}.{self.overload} (re-created from stored programs) "
                f"got an undefined output gradient; its stored backward needs all of them."
            )
        out = v.bwd([*flat, *grads, *ctx.state_ints])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(v.grads, out):
            if ctx.needs_input_grad[pos]:
                res[pos] = g
        return tuple(res)

    def _variant_of_state(self, state: str) -> _Variant:
        try:
            return self.variants[int(state)]
        except (ValueError, IndexError):
            raise RuntimeError(
                f"torch_opaque: {self.qual}_bwd.{self.overload} (re-created from stored "
                f"programs) was called with state {state!r} that its forward did not produce; "
                f"a graph traced in the saving process cannot call the stored backward."
            ) from None

    # fake kernels (called from Python by PyTorch)
    def fake_fwd(self, *args, **kwargs):
        # `_fwd`'s last argument is needs_input_grad (none when called as the op).
        needs = kwargs.pop("needs_input_grad", None)
        if len(args) > len(self.schema.arguments):
            needs = args[len(self.schema.arguments)]
            args = args[: len(self.schema.arguments)]
        args = _full_args(self.schema, args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, residuals, ints = self.split(v, v.fwd.forward(flat))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        outs = list(_unalias(tuple(outs), inputs))
        residuals = list(_unalias(tuple(residuals), inputs + outs))
        if needs is not None:
            _C.set_forward_record(list(v.saved), list(v.non_diff), True, str(v.id), list(ints))
        return (*outs, residuals)

    def fake_op(self, *args, **kwargs):
        outs = self.fake_fwd(*args, **kwargs)[:-1]
        return outs[0] if len(outs) == 1 else outs

    def fake_bwd(self, saved, grads, needs_input_grad, state, state_ints):
        v = self._variant_of_state(state)
        flat = [t for t, none in zip(saved, v.saved_none) if not none]
        out = v.bwd.forward([*flat, *grads, *state_ints])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(v.grads, out):
            if needs_input_grad[pos]:
                res[pos] = g
        inputs = [t for t in (*saved, *grads) if t is not None]
        return list(_unalias(tuple(res), inputs))

    def decomposition(self, *args, **kwargs):
        """The forward as ATen ops (for passes.inline): runs the stored program."""
        args = _full_args(self.schema, args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, _, _ = self.split(v, v.fwd.forward(flat))
        return outs[0] if self.n_out == 1 else tuple(outs)


class _StoredRunner:
    """A stored overload's forward, shaped like kernels.Runner for the C++ bridge."""

    setup_context = None
    convs = ()

    def __init__(self, sov: _StoredOverload):
        self.sov = sov
        self.fn_name = f"{sov.qual}.{sov.overload}"
        self.forward = sov.forward
        self.n_out = sov.n_out
        self.no_grad = (False,) * len(sov.schema.arguments)

    def outputs(self, out) -> tuple:
        return tuple(out)

    @staticmethod
    def encode_ctx(ctx) -> tuple:
        state, ints = ctx.stored_state
        return state, ints, list(ctx.saved_tensors)


class _StoredBackwardRunner:
    """A stored overload's backward, shaped like kernels.BackwardRunner."""

    def __init__(self, sov: _StoredOverload):
        self.sov = sov
        self.fn_name = f"{sov.qual}.{sov.overload}"
        self.backward = sov.backward
        self.tensor_flags = tuple(
            isinstance(a.type, torch.TensorType)
            or (isinstance(a.type, torch.OptionalType) and isinstance(a.type.getElementType(), torch.TensorType))
            for a in sov.schema.arguments
        )

    def decode_ctx(self, state: str, saved: tuple, state_ints) -> tuple:
        return saved, {"variant": self.sov._variant_of_state(state), "state_ints": state_ints}

    def _fix_count(self, res):
        raise RuntimeError(f"torch_opaque: {self.fn_name}: stored backward returned {len(res)} gradients")

    def _raise_bad_gradients(self, res):
        raise RuntimeError(f"torch_opaque: {self.fn_name}: stored backward returned a bad gradient")


class _StoredOp:
    def __init__(self, entry: dict):
        self.entry = entry
        self.entry_overloads = {ov["overload"]: ov for ov in entry["overloads"]}
        self.overloads: dict = {}  # overload -> _StoredOverload
        self.libs: list = []


_STORED: dict = {}  # (namespace, name) -> _StoredOp, ops re-created from archives


def stored_overload(ns: str, name: str, overload: str) -> Optional[_StoredOverload]:
    """The re-created overload of an op loaded from a self-contained archive."""
    op = _STORED.get((ns, name))
    return None if op is None else op.overloads.get(overload)


def _define_stored(op_entry: dict, ov_entry: dict, texts: dict, description: str):
    ns, name = op_entry["namespace"], op_entry["name"]
    overload = ov_entry["overload"]
    qual = f"{ns}::{name}"
    n_out = ov_entry["n_out"]
    schema = torch._C.parse_schema(ov_entry["schema"])
    variants = [
        _Variant(e, {w: texts[e[w]] for w in ("fwd", "bwd")}, schema) for e in ov_entry["variants"]
    ]
    sov = _StoredOverload(qual, overload, schema, n_out, variants)
    _C.define_op(
        ns,
        name,
        "" if overload == "default" else overload,
        ov_entry["arguments"],
        ["Tensor"] * n_out,
        _StoredRunner(sov),
        _StoredBackwardRunner(sov),
    )
    defined = str(_schema_or_none(ns, name, overload))
    if defined != ov_entry["schema"]:
        raise ValueError(f"its arguments define {defined}, not {ov_entry['schema']}")
    stored = _STORED.get((ns, name))
    if stored is None:
        stored = _STORED[(ns, name)] = _StoredOp(op_entry)
    lib = torch.library.Library(ns, "FRAGMENT")
    stored.libs.append(lib)
    torch.library.register_fake(_op_overload(ns, name, overload), sov.fake_op, lib=lib)
    torch.library.register_fake(_op_overload(ns, name + "_fwd", overload), sov.fake_fwd, lib=lib)
    torch.library.register_fake(_op_overload(ns, name + "_bwd", overload), sov.fake_bwd, lib=lib)
    stored.overloads[overload] = sov
    return sov


