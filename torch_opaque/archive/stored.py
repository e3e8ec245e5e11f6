"""Self-contained archives, load side: ops re-created from their stored
programs, beside the real ones (Note [Stored ops beside real ones]).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import threading
from typing import Callable, Optional

import torch

from .._native import _C
from .._impl.bridge import BackwardChecks, ForwardChecks, SavedKind, saved_triples
from .._impl.tracing import unalias
from ..errors import ArchiveError
from ..ops import register_source, schema_or_none
from .manifest import OpEntry, OverloadRecord, TensorSig, VariantRecord
from .program import module_of, program_from_bytes
from .._impl.calls import CallSignature, full_args, tensor_flags
from .values import decode_value, dtype_name, encode_value, normalize_value


def _program_module(text: str, which: str, description: str, qual: str, limits, rename: dict):
    where = f"the stored {which} program of {qual}"
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} cannot be read (not base64: "
            f"{e}); the archive is corrupted."
        ) from e
    try:
        prog = program_from_bytes(data, description, where, limits, rename)
        return module_of(prog, where, description)
    except ArchiveError as e:
        raise ArchiveError(f"{e} (The stored {which} program is corrupted or crafted.)") from e


def variant_payload(v: VariantRecord, payloads: dict) -> dict:
    """The base64 texts of a variant's programs: "fwd", "bwd" (None when not
    stored) and "partial" (in the order of ``v.partial``)."""
    return {"fwd": payloads[v.fwd], "bwd": None if v.bwd is None else payloads[v.bwd],
            "partial": [payloads[p.bwd] for p in v.partial]}


class _Variant:
    """One stored kind of call: its record and, once deserialized, its programs."""

    def __init__(self, record: VariantRecord, payload: dict, schema):
        self.record = record
        self.payload = payload  # variant_payload(): base64 texts (kept for re-saving)
        self.id = record.id
        self.args = record.args
        self.n_res = record.n_residuals
        self.n_ints = record.n_state_ints
        self.saved = record.saved_codes()
        self.saved_none = [s.kind == "none" for s in record.saved]
        self.non_diff = list(record.non_differentiable)
        self.grads = list(record.grads)
        self.materialize = record.materialize
        self.schema = schema
        self.fwd = None
        self.bwd = None
        self.partial: dict = {}  # defined-gradient pattern -> (positions, module)

    def deserialize(self, description: str, qual: str, limits, rename: dict) -> None:
        texts = [("fwd", self.payload["fwd"]), ("bwd", self.payload["bwd"])]
        texts += [("bwd", t) for t in self.payload["partial"]]
        modules = [None if text is None else _program_module(text, which, description, qual, limits, rename)
                   for which, text in texts]  # fmt: skip
        self.fwd, self.bwd = modules[0], modules[1]
        self.partial = {tuple(p.defined): (list(p.grads), m)
                        for p, m in zip(self.record.partial, modules[2:])}

    def modules(self) -> list:
        return [m for m in (self.fwd, self.bwd, *(m for _, m in self.partial.values())) if m is not None]

    def backward_program(self, qual: str, grads) -> tuple:
        """(positions, program, program inputs from ``grads``) of a backward call:
        the stored backward, or the one for this pattern of undefined output
        gradients (Note [Stored programs run in eager's state] in trace.py)."""
        if self.bwd is None and not self.grads and self.record.bwd_error is None:
            return [], _NO_GRADIENTS, []  # Note [A backward with no gradients] in trace.py
        if self.bwd is None:
            raise RuntimeError(
                f"torch_opaque: {self.record.bwd_error or f'the backward of {qual} was not stored'}, "
                f"so the self-contained archive this op was loaded from holds its forward only: "
                f"run it for inference (torch.no_grad()), or make the backward traceable and save "
                f"again (or load with allow=[<defining module>] to run the original Function)."
            )
        defined = tuple(g is not None for g in grads)
        if all(defined):
            return self.grads, self.bwd, list(grads)
        if defined in self.partial:
            positions, module = self.partial[defined]
            return positions, module, [g for g in grads if g is not None]
        undefined = [k for k, d in enumerate(defined) if not d]
        raise RuntimeError(
            f"torch_opaque: {qual} (re-created from stored programs) got undefined gradients "
            f"for output(s) {undefined}, and its archive stores no backward for them ("
            + ("its forward materializes gradients" if self.materialize else
               "the backward could not be traced with them undefined, or the op has more "
               "than 4 outputs") + "); make every output take part in the loss."
        )

    def match(self, args, fake: bool) -> Optional[list]:
        """The flat program inputs for this call, or None when not covered."""
        if len(args) != len(self.args):
            return None
        tensors, ints = [], []
        for d, v, arg in zip(self.args, args, self.schema.arguments):
            k = d.kind
            if k == "none":
                if v is not None:
                    return None
            elif k == "tensor":
                if not _tensor_matches(d.tensor, v, fake):
                    return None
                tensors.append(v)
            elif k == "tensors":
                if v is None or len(v) != len(d.items):
                    return None
                for item, t in zip(d.items, v):
                    if not _tensor_matches(item, t, fake):
                        return None
                    tensors.append(t)
            elif k == "dyn":
                if not isinstance(v, (int, torch.SymInt)):
                    return None
                ints.append(v)
            else:
                try:
                    if encode_value(normalize_value(v, arg)) != d.value:
                        return None
                except TypeError:
                    return None
        return tensors + ints


def _tensor_matches(d: TensorSig, t, fake: bool) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if dtype_name(t.dtype) != d.dtype or t.dim() != len(d.shape):
        return False
    if fake:
        return True
    return all(s is None or s == n for s, n in zip(d.shape, t.shape))


def _covered(variants) -> str:
    lines = []
    for v in variants:
        parts = []
        for d, a in zip(v.args, v.schema.arguments):
            k = d.kind
            if k == "tensor":
                shape = ", ".join("*" if s is None else str(s) for s in d.tensor.shape)
                parts.append(f"{a.name}: {d.tensor.dtype}[{shape}]")
            elif k == "tensors":
                parts.append(f"{a.name}: {len(d.items)} tensors")
            elif k == "const":
                parts.append(f"{a.name}={decode_value(d.value)!r}")
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


def _saved_fits(v: _Variant, saved) -> bool:
    """Whether a ``_bwd`` call's saved tensors are those of variant ``v``: as
    many, None in the same places, the dtypes of saved inputs alike."""
    if len(saved) != len(v.saved_none):
        return False
    for t, none, rec in zip(saved, v.saved_none, v.record.saved):
        if (t is None) != none:
            return False
        if t is not None and rec.kind == "input" and v.args[rec.index].kind == "tensor":
            if dtype_name(t.dtype) != v.args[rec.index].tensor.dtype:
                return False
    return True


# Note [Stored backward of training programs]
# A training program (torch_opaque.export_training) calls ``Name_fwd`` and
# ``Name_bwd`` itself; its ``Name_bwd`` calls carry the state string the
# Function's forward recorded (its ctx attributes), not the variant id the
# stored forward records. Saving self-contained stores the kinds of call of the
# ``Name_fwd`` nodes as usual, each with the state its traced forward recorded
# (VariantRecord.state), and the stored ``Name_bwd`` kernel (real and fake)
# finds its variant by that state and the saved tensors; the graph is saved
# unchanged, so it loads the same with the real Function (allow=) or from the
# stored programs.


class StoredOverload:
    """Kernels of one overload re-created from stored programs."""

    def __init__(self, op: OpEntry, record: OverloadRecord, registered: str, schema, variants: list):
        self.op = op  # the manifest entry (module and class, for messages and re-saving)
        self.record = record
        self.qual = op.qualified_name
        self.overload = record.overload  # as the saving process called it
        self.registered = registered  # the overload defined here (Note [Stored ops beside real ones])
        self.schema = schema
        self.n_out = record.n_out
        self.variants = variants
        self.ready = False  # every variant's programs deserialized
        self.refused: Optional[str] = None  # why the archive that defined it was refused

    def deserialize(self, description: str, limits, rename: dict) -> None:
        for v in self.variants:
            v.deserialize(description, f"{self.qual}.{self.overload}", limits, rename)
        self.ready, self.refused = True, None

    def refuse(self, why: str) -> None:
        """The archive defining this overload was refused after it was defined
        (Note [Stored call graph]): it keeps no programs, and a call says why."""
        self.ready, self.refused = False, why
        for v in self.variants:
            v.fwd = v.bwd = None
            v.partial = {}

    def _check_usable(self) -> None:
        if self.refused is not None:
            raise ArchiveError(
                f"torch_opaque: {self.qual}.{self.overload} has no stored programs to run: the "
                f"self-contained archive that defined it was refused when it loaded "
                f"({self.refused[:300]}). Load an archive whose stored programs load, or load "
                f"with allow=[<defining module>] to run the original Function."
            )

    def select(self, args, fake: bool):
        self._check_usable()
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
        sources = {SavedKind.INPUT: lambda i, j: args[i], SavedKind.INPUT_LIST_ITEM: lambda i, j: args[i][j],
                   SavedKind.OUTPUT: lambda i, j: outs[i], SavedKind.RESIDUAL: lambda i, j: residuals[i]}  # fmt: skip
        saved = [
            None if kind is SavedKind.NONE else sources[kind](i, j)
            for kind, i, j in saved_triples(v.saved)
        ]
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*(o for o, nd in zip(outs, v.non_diff) if nd))
        ctx.set_materialize_grads(v.materialize)
        ctx.stored_state = (str(v.id), list(ints))  # read by _StoredRunner.encode_ctx
        return tuple(outs)

    def backward(self, ctx, *grads):
        v = getattr(ctx, "variant", None)
        if v is None:
            # a training program's call with an empty state (a Function that
            # keeps no ctx attributes): the bridge decodes no attributes
            v = self._variant_of_state("", tuple(ctx.saved_tensors))
        flat = [t for t, none in zip(ctx.saved_tensors, v.saved_none) if not none]
        positions, program, given = v.backward_program(f"{self.qual}.{self.overload}", grads)
        out = program([*flat, *given, *getattr(ctx, "state_ints", ())])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(positions, out):
            if ctx.needs_input_grad[pos]:
                res[pos] = g
        return tuple(res)

    def _variant_of_state(self, state: str, saved=None) -> _Variant:
        """The variant a ``_bwd`` call belongs to: ``state`` is the variant's id
        when the stored forward ran, or the Function's own ctx state when the
        call comes from a saved training program (Note [Stored backward of
        training programs])."""
        self._check_usable()
        if state.isdigit() and int(state) < len(self.variants):
            return self.variants[int(state)]
        for v in self.variants:
            if v.record.state == state and (saved is None or _saved_fits(v, saved)):
                return v
        raise RuntimeError(
            f"torch_opaque: {self.qual}_bwd.{self.overload} (re-created from stored "
            f"programs) was called with state {state[:200]!r}, which none of its stored "
            f"forward calls {_covered(self.variants)} recorded (with these saved tensors); "
            f"save the program again with self_contained=True, or load it with "
            f"allow=[<defining module>] to run the original Function."
        )

    # fake kernels (called from Python by PyTorch)
    def fake_fwd(self, *args, **kwargs):
        # `_fwd`'s last argument is needs_input_grad (none when called as the op).
        sig = CallSignature.of_schema(self.schema)
        args, kwargs, needs = sig.split_needs_input_grad(args, kwargs)
        args = sig.complete(args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, residuals, ints = self.split(v, v.fwd.forward(flat))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        outs = list(unalias(tuple(outs), inputs))
        residuals = list(unalias(tuple(residuals), inputs + outs))
        if needs is not None:
            _C.set_forward_record(list(v.saved), list(v.non_diff), v.materialize, str(v.id), list(ints))
        return (*outs, residuals)

    def fake_op(self, *args, **kwargs):
        outs = self.fake_fwd(*args, **kwargs)[:-1]
        return outs[0] if len(outs) == 1 else outs

    def fake_bwd(self, saved, grads, needs_input_grad, state, state_ints):
        v = self._variant_of_state(state, saved)
        flat = [t for t, none in zip(saved, v.saved_none) if not none]
        positions, program, given = v.backward_program(f"{self.qual}.{self.overload}", grads)
        out = program.forward([*flat, *given, *state_ints])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        res = [None] * len(self.schema.arguments)
        for pos, g in zip(positions, out):
            if needs_input_grad[pos]:
                res[pos] = g
        inputs = [t for t in (*saved, *grads) if t is not None]
        return list(unalias(tuple(res), inputs))

    def decomposition(self, *args, **kwargs):
        """The forward as ATen ops (for passes.inline): runs the stored program."""
        args = full_args(self.schema, args, kwargs)
        v, flat = self.select(args, fake=True)
        outs, _, _ = self.split(v, v.fwd.forward(flat))
        return outs[0] if self.n_out == 1 else tuple(outs)


class _StoredRunner(ForwardChecks):
    """A stored overload's forward, for the C++ bridge (bridge.ForwardRunnerProtocol)."""

    setup_context = None
    convs = ()
    keeps_ctx_objects = False  # the bridge calls encode_ctx at once

    def __init__(self, sov: StoredOverload):
        self.sov = sov
        self.fn_name = f"{sov.qual}.{sov.overload}"
        self.forward = sov.forward
        self.n_out = sov.n_out
        self.arg_names = tuple(a.name for a in sov.schema.arguments)
        self.no_grad = (False,) * len(sov.schema.arguments)

    def convert_args(self, args: tuple) -> tuple:
        return args

    @staticmethod
    def encode_ctx(ctx) -> tuple:
        state, ints = ctx.stored_state
        return state, ints, list(ctx.saved_tensors)


class _StoredBackwardRunner(BackwardChecks):
    """A stored overload's backward, for the C++ bridge (bridge.BackwardRunnerProtocol)."""

    def __init__(self, sov: StoredOverload):
        self.sov = sov
        self.fn_name = f"{sov.qual}.{sov.overload}"
        self.backward = sov.backward
        self.arg_names = tuple(a.name for a in sov.schema.arguments)
        self.tensor_flags = tensor_flags(sov.schema)

    def decode_ctx(self, state: str, saved: tuple, state_ints) -> tuple:
        return saved, {"variant": self.sov._variant_of_state(state, saved), "state_ints": state_ints}


# Note [Stored ops beside real ones]
# An op re-created from the programs of a self-contained archive is defined as
# its own overload of the op's name, ``<overload>_stored_<digest>``, where the
# digest covers the overload's schema, its variant records and its program
# bytes; the loaded graph (and the stored programs that call each other) are
# renamed to call it before they are deserialized (program.check_model_json).
# So:
# * the real Function keeps its name: importing its module later and calling it
#   defines ``ns::Name.<overload>`` as usual, next to the stored overload; a
#   program loaded before keeps running the stored programs, a program loaded
#   after (with allow=) runs the Function;
# * any number of archives storing the same op for different kinds of call
#   each get their own overload; archives with the same stored content share
#   one (the digest is the same), so loading an archive twice defines nothing new;
# * re-saving a loaded program keeps the stored programs; the ``_stored_``
#   suffix is replaced, not stacked, when that archive is loaded again.
# An op the process already has (registered Function, or an allowed module)
# is always preferred over stored programs, as before.

_STORED_SUFFIX = re.compile(r"_stored_[0-9a-f]{12}$")
_STORED: dict = {}  # (namespace, name, registered overload) -> StoredOverload
_LOCK = threading.Lock()  # two threads loading the same archive define it once


def is_stored_name(overload: str) -> bool:
    return _STORED_SUFFIX.search(overload) is not None


def stored_overload(ns: str, name: str, overload: str) -> Optional[StoredOverload]:
    """The re-created overload of an op loaded from a self-contained archive."""
    return _STORED.get((ns, name, overload))


def all_stored() -> dict:
    """(namespace, name, registered overload) -> StoredOverload, a snapshot."""
    with _LOCK:
        return dict(_STORED)


def defined_by(ns: str, name: str) -> Optional[str]:
    """'module.Class' of the Function an op re-created here came from, if known."""
    for (sns, sname, _), sov in list(_STORED.items()):
        if (sns, sname) == (ns, name) and sov.op.module:
            return f"{sov.op.module}.{sov.op.cls}"
    return None


class _StoredOpSource:
    """What graph passes and the CLI learn about stored ops, through ops.py
    (Note [Op sources] in torch_opaque/ops.py)."""

    @staticmethod
    def defined_by(ns: str, name: str) -> Optional[str]:
        return defined_by(ns, name)

    @staticmethod
    def decomposition(info) -> Optional[Callable]:
        """The op (in its role) as its stored programs compute it, for passes.inline."""
        sov = stored_overload(info.namespace, info.name, info.overload)
        if sov is None:
            return None
        if info.role == "op":
            return sov.decomposition
        if info.role == "fwd":

            def forward(*args, **kwargs):
                args = full_args(sov.schema, args, kwargs)
                v, flat = sov.select(args, fake=True)
                outs, residuals, _ = sov.split(v, v.fwd.forward(flat))
                return (*outs, list(residuals))

            return forward
        return sov.fake_bwd


def stored_name(ov: OverloadRecord, payloads: dict) -> str:
    """The overload name the stored programs of ``ov`` are defined under."""
    h = hashlib.sha256()
    h.update(ov.arguments.encode())
    h.update(str(ov.n_out).encode())
    for v in ov.variants:
        d = v.to_json()
        d.pop("fwd"), d.pop("bwd", None)
        for part in d.get("partial", ()):
            part.pop("bwd")
        h.update(json.dumps(d, sort_keys=True).encode())
        for name in v.program_names():
            h.update(payloads[name].encode())
    base = _STORED_SUFFIX.sub("", ov.overload)
    return f"{base}_stored_{h.hexdigest()[:12]}"


def renames(ns: str, name: str, overload: str, registered: str) -> dict:
    """Serialized call targets of the saved overload (and of the overload it was
    stored from, which stored programs call) -> those of the stored one."""
    out = {}
    for ov in {overload, _STORED_SUFFIX.sub("", overload)}:
        for s in ("", "_fwd", "_bwd"):
            out[f"torch.ops.{ns}.{name}{s}.{ov}"] = f"torch.ops.{ns}.{name}{s}.{registered}"
    return out


def define_stored(op: OpEntry, ov: OverloadRecord, payloads: dict, registered: str):
    """Defines ``ns::name.<registered>`` running the stored programs of ``ov``;
    (StoredOverload, whether it was defined now). The programs are deserialized
    later (_Variant.deserialize), once every op they call exists."""
    with _LOCK:
        existing = _STORED.get((op.namespace, op.name, registered))
        if existing is not None:
            # not ready: an earlier load failed to read its programs; read them again
            return existing, not existing.ready
        return _define(op, ov, payloads, registered), True


def _define(op: OpEntry, ov: OverloadRecord, payloads: dict, registered: str) -> StoredOverload:
    ns, name = op.namespace, op.name
    schema = torch._C.parse_schema(ov.schema)
    variants = [_Variant(v, variant_payload(v, payloads), schema) for v in ov.variants]
    record = OverloadRecord(**{**ov.__dict__})
    sov = StoredOverload(op, record, registered, schema, variants)
    _C.define_op(
        ns,
        name,
        registered,
        ov.arguments,
        # (named as the saved op's: a C++ op's output_names)
        [f"Tensor {r.name}" if r.name else "Tensor" for r in schema.returns],
        _StoredRunner(sov),
        _StoredBackwardRunner(sov),
    )
    defined = schema_or_none(ns, name, registered)

    def signature(x) -> str:
        t = str(x)
        return t[t.index("(") :]

    if signature(defined) != signature(schema):
        raise ValueError(f"its arguments define {defined}, not {ov.schema}")
    sov.schema = defined
    for v in variants:
        v.schema = defined
    sov.lib = torch.library.Library(ns, "FRAGMENT")
    packet = getattr(torch.ops, ns)
    for suffix, fake in (("", sov.fake_op), ("_fwd", sov.fake_fwd), ("_bwd", sov.fake_bwd)):
        target = getattr(getattr(packet, name + suffix), registered)
        torch.library.register_fake(target, fake, lib=sov.lib)
    _STORED[(ns, name, registered)] = sov
    register_source(_StoredOpSource)
    return sov


class _NoGradients:
    """The stored backward of a Function whose backward returns no gradient
    (Note [A backward with no gradients] in trace.py): no program, no outputs."""

    def __call__(self, inputs):
        return []

    def forward(self, inputs):
        return []


_NO_GRADIENTS = _NoGradients()
