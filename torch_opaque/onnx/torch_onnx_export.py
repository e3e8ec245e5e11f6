"""Opaque ops in ``torch.onnx.export(model, args, dynamo=True)``, the exporter
users already call: the translations its registry gets
(Note [torch.onnx.export of opaque ops]).

Note [torch.onnx.export of opaque ops]
torch's exporter (2.13) has no registry a library extends once for every
export: each call builds ``ONNXRegistry.from_torchlib()`` afresh (torch's own
translations, registered with its ``onnx_impl`` decorator) and adds that call's
``custom_translation_table``. So torch_opaque adds its entries to every
registry ``from_torchlib`` builds (integrations/onnx_registry.py wraps it when torch.onnx
first imports the module; torch_opaque never imports torch.onnx or onnxscript
itself):

* every opaque op in the dispatcher, in its three roles (``Name``,
  ``Name_fwd``, ``Name_bwd``; ops from Python, C++ and stored programs alike: a
  scan of ~3,600 op names, ~10 ms per export), gets an entry registered as a
  ``custom_translation_table`` entry is, but before the caller's table: an
  entry the caller passes for an opaque op wins (torch_opaque.onnx.export
  passes its own).
* torch.onnx calls a translation with the call's arguments only. This one finds
  the FX node it translates, and the model being built, in its caller's frame
  (torch's ``_handle_call_function_node_with_lowering``: locals ``node`` and
  ``model``, checked by type and target); when they are not there (an exporter
  that changed) it refuses with a message pointing at torch_opaque.onnx.export.
* with the node it does what torch_opaque.onnx.export does per call (Note [ONNX
  export of opaque ops] in onnx/__init__.py, the same checks and messages): one
  custom node ``namespace::Name``, and its model-local function built at once
  and handed to torch.onnx through the recorder it translates into (torch adds
  a recorder's functions to the model). The state of one export (functions
  made, training call kinds) lives in ``model.meta``.
* torch.onnx's optimizer (``optimize=True``, the default) inlines every
  model-local function, torch's own subgraph functions included: the default
  export holds each call's forward inlined, as the stock Function's export
  does; ``optimize=False`` keeps the custom node and its function, as
  torch_opaque.onnx.export gives. Both run in onnxruntime.
* a training program (``export_training``): torch.onnx makes graph outputs of
  the user outputs only, so the loss and gradients of a training step are not
  outputs of its ONNX model; ``torch_opaque.onnx.export`` exports them.
"""

from __future__ import annotations

import sys

import onnx_ir as ir
import onnxscript.evaluator
import torch

from ..errors import OnnxExportError
from ..ops import ROLES, opaque_info
from .exporter import _Exporter
from .registry import reuse_torchlib_registry

_STATE_KEY = "torch_opaque.onnx.export_state"


def opaque_overloads() -> list:
    """The OpOverload of every opaque op in the dispatcher, in every role."""
    names = set(torch._C._dispatch_get_all_op_names())
    found = []
    for full in names:
        qual, _, overload = full.partition(".")
        if not qual.endswith("_fwd"):
            continue
        base = qual[: -len("_fwd")]
        suffix = f".{overload}" if overload else ""
        if f"{base}{suffix}" not in names or f"{base}_bwd{suffix}" not in names:
            continue
        ns, _, name = base.partition("::")
        for role_suffix in ("", "_fwd", "_bwd"):
            try:
                packet = getattr(getattr(torch.ops, ns), name + role_suffix)
                found.append(getattr(packet, overload or "default"))
            except (AttributeError, RuntimeError):
                continue
    return found


def add_translations(registry) -> None:
    """Give a registry torch.onnx just built a translation of every opaque op
    (those defined while it is in use join it: integrations/onnx_registry.py)."""
    register_translations(registry, opaque_overloads())


def register_translations(registry, targets) -> None:
    for target in targets:
        if not registry.is_registered(target):
            registry.register_op(target, translate_opaque_call)


def translate_opaque_call(*args, **kwargs):
    """The registry entry of every opaque op (Note [torch.onnx.export of opaque ops])."""
    fx_node, model = _translating()
    info = opaque_info(fx_node.target)
    if info is None or info.role not in ROLES:  # pragma: no cover - registered as opaque
        raise OnnxExportError(f"torch_opaque.onnx: {fx_node.target} is not an opaque op.")
    state = model.meta.get(_STATE_KEY)
    if state is None:
        state = model.meta[_STATE_KEY] = _OneExport(model.opset_imports.get("", 18))
    return state.translate(fx_node, info, args, kwargs)


def _translating() -> tuple:
    """The FX node torch.onnx is translating and the model it builds, from the
    frame that called the translation."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            break
        local = frame.f_locals
        node, model = local.get("node"), local.get("model")
        if isinstance(node, torch.fx.Node) and isinstance(model, ir.Model):
            if opaque_info(node.target) is not None:
                return node, model
        frame = frame.f_back
    raise OnnxExportError(
        "torch_opaque.onnx: torch.onnx.export called torch_opaque's translation of an opaque op "
        "from a place it does not know (this torch's exporter changed), so the op cannot be "
        "translated there. Export with torch_opaque.onnx.export(model, args) instead, which "
        "gives the same ONNX model, or report this torch version."
    )


class _OneExport(_Exporter):
    """torch_opaque.onnx.export's exporter, driven one call at a time by torch.onnx."""

    def __init__(self, opset: int):
        super().__init__(mapping={}, functions=True, opset=opset, kw={})

    def translate(self, fx_node: torch.fx.Node, info, args, kwargs):
        self._check(fx_node, info)
        self._emitted = emitted = []
        outputs = self._translation(info)(*args, **kwargs)
        recorder = onnxscript.evaluator.default()
        functions = getattr(recorder, "functions", None)
        if not isinstance(functions, dict):  # pragma: no cover - another torch version
            raise OnnxExportError(
                "torch_opaque.onnx: torch.onnx.export records translations in a way this "
                "torch_opaque does not know, so an opaque op's ONNX function cannot be added. "
                "Export with torch_opaque.onnx.export(model, args) instead."
            )
        for node, node_info in emitted:
            node.meta["node"] = fx_node  # torch.onnx sets it too, once this returns
            flag = _exporting_flag()
            try:
                with reuse_torchlib_registry():
                    node.overload = self._function_for(node, node_info)
            finally:
                _exporting_flag(flag)  # the body's own export ended "exporting"
            ident = (node_info.namespace, node.op_type, node.overload)
            functions[ident] = self.functions[ident]
        return outputs


def _exporting_flag(value=None):
    """torch.onnx.is_in_onnx_export()'s flag of the dynamo exporter: read, or set."""
    from torch.onnx._internal.exporter import _flags

    if value is None:
        return getattr(_flags, "_is_onnx_exporting", None)
    if hasattr(_flags, "_is_onnx_exporting"):
        _flags._is_onnx_exporting = value
    return value
