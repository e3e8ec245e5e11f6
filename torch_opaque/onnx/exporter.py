"""``torch_opaque.onnx.export``: the model through torch.export and
torch.onnx, with a custom translation for every opaque op in its graphs
(Note [ONNX export of opaque ops] in torch_opaque/onnx/__init__.py)."""

from __future__ import annotations

from typing import Callable, Optional

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
import torch
from onnxscript.values import OnnxFunction, Opset

from .._impl.function import lookup
from ..errors import OnnxExportError
from ..ops import OpaqueInfo, opaque_nodes
from .functions import FunctionBodies, add_functions
from .nodes import CUSTOM_OPSET_VERSION, bind_call, record_node, call_constants, split_call, tensor_arity
from .registry import reuse_torchlib_registry
from .training import TrainingCalls, ValueList, with_user_outputs


def export(
    model_or_ep,
    args: tuple = (),
    path: Optional[str] = None,
    *,
    dynamic_shapes=None,
    mapping: Optional[dict] = None,
    functions: bool = True,
    inline: bool = False,
    opset: int = 18,
    **kw,
) -> onnx.ModelProto:
    """Export a model (or an ExportedProgram) with opaque ops to ONNX.

    Every opaque op call becomes one node ``<namespace>::<Name>`` (Note [ONNX
    export of opaque ops]). ``mapping`` maps ``"ns::Name"`` (or the
    autograd.Function class) to a standard ONNX op name, an onnxscript function
    or a torch.onnx translation callable instead. ``functions`` adds the
    forward of each unmapped op as a model-local function (so onnxruntime runs
    the model); ``inline`` inlines all model-local functions. ``dynamic_shapes``
    as for torch.export (``torch.export.Dim``; a string names a dynamic axis).
    Other keywords go to ``torch.onnx.export``, except ``kwargs=`` (the model's
    keyword inputs). Returns the ModelProto; saves it to ``path`` if given.
    """
    if isinstance(model_or_ep, torch.export.ExportedProgram):
        # a training step (export_training): loss and gradients become the outputs
        ep = with_user_outputs(model_or_ep)
    else:
        args = args if isinstance(args, tuple) else (args,)
        dims = torch.utils._pytree.tree_map(  # "name" axes (torch.onnx style) -> DYNAMIC
            lambda a: torch.export.Dim.DYNAMIC if isinstance(a, str) else a, dynamic_shapes
        )
        ep = torch.export.export(
            model_or_ep, args, kw.pop("kwargs", None), dynamic_shapes=dims, strict=False
        )
    if dynamic_shapes is not None:
        kw["dynamic_shapes"] = dynamic_shapes  # torch.onnx names the axes after them
    exporter = _Exporter(_normalize_mapping(mapping or {}), functions, opset, kw)
    with reuse_torchlib_registry():
        model = exporter.to_ir(ep, top=True)
    add_functions(model, exporter.functions)
    if inline:
        ir_passes.InlinePass()(model)
    ir_passes.RemoveUnusedFunctionsPass()(model)
    ir_passes.RemoveUnusedOpsetsPass()(model)
    proto = ir.serde.serialize_model(model)
    if path is not None:
        onnx.save(proto, path)
    return proto


def _normalize_mapping(mapping: dict) -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(key, type):
            fn = lookup(key)
            if fn is None:
                raise OnnxExportError(
                    f"torch_opaque.onnx: mapping key {key.__qualname__} is not a torch_opaque op; "
                    f"decorate it with @torch_opaque.op or use the 'namespace::Name' string."
                )
            key = f"{fn.namespace}::{fn.name}"
        if not (isinstance(value, str) or callable(value)):
            raise OnnxExportError(
                f"torch_opaque.onnx: mapping[{key!r}] must be an ONNX op name or an onnxscript "
                f"function, not {type(value).__name__}."
            )
        out[key] = value
    return out



# ---- the exporter ------------------------------------------------------------------------


class _Exporter(FunctionBodies):
    def __init__(self, mapping: dict, functions: bool, opset: int, kw: dict):
        self.mapping, self.with_functions, self.opset, self.kw = mapping, functions, opset, kw
        self.functions: dict = {}  # ir.OperatorIdentifier -> ir.Function
        self.seen: set = set()  # qualified names of the opaque ops met (nested ones too)
        self._emitted: list = []  # (ir.Node, OpaqueInfo): custom nodes needing a function
        self.training = TrainingCalls()  # Note [ONNX export of training programs]

    def to_ir(self, ep: torch.export.ExportedProgram, top: bool = False) -> ir.Model:
        table = {}
        for gm in ep.graph_module.modules():
            if isinstance(gm, torch.fx.GraphModule):
                for fx_node, info in opaque_nodes(gm):
                    self._check(fx_node, info)
                    table[info.target] = self._translation(info)
        kw = dict(self.kw) if top else {}
        table.update(kw.pop("custom_translation_table", None) or {})
        self._emitted = emitted = []
        model = torch.onnx.export(
            ep, (), dynamo=True, custom_translation_table=table, opset_version=self.opset,
            verbose=False, **kw,
        ).model
        for fn in model.functions.values():
            self.functions.setdefault(fn.identifier(), fn)
        model.functions.clear()
        if self.with_functions:
            for node, info in emitted:
                if node.graph is not None:  # still in the graph after optimization
                    node.overload = self._function_for(node, info)
        unknown = sorted(set(self.mapping) - self.seen)
        if top and unknown:  # checked last: ops called inside a forward count too
            raise OnnxExportError(
                f"torch_opaque.onnx: mapping names {', '.join(unknown)}, but the model has no "
                f"such opaque op. Opaque ops found: {', '.join(sorted(self.seen)) or 'none'}."
            )
        return model

    def _check(self, fx_node: torch.fx.Node, info: OpaqueInfo) -> None:
        qual, mapped = info.qualified_name, self.mapping.get(info.qualified_name)
        self.seen.add(qual)
        if getattr(info.target, "_schema", None) is not None and info.target._schema.is_mutable:
            raise OnnxExportError(  # Note [In-place Functions] (_impl/in_place.py)
                f"torch_opaque.onnx: {qual} modifies its arguments in place (ctx.mark_dirty); "
                f"ONNX export of in-place opaque ops is not supported yet. Export a model "
                f"without it, or make the Function's forward return a new tensor."
            )
        if self.with_functions and mapped is None:
            _refuse_list_results(info)
        if info.role != "op":
            self._check_training(fx_node, info)
            return
        if callable(mapped) and not isinstance(mapped, OnnxFunction):
            return  # a translation function: torch.onnx calls it with the node's arguments
        args = bind_call(info.target, fx_node.args, fx_node.kwargs)
        _refuse_symbolic(
            args, qual, fx_node, "(e.g. a dynamic size)", f"Make it static, or pass mapping="
            f"{{'{qual}': <translation function>}} that takes it as an input."
        )
        if isinstance(mapped, str):
            if not onnx.defs.has(mapped):
                raise OnnxExportError(
                    f"torch_opaque.onnx: mapping['{qual}'] = '{mapped}' is not a standard ONNX "
                    f"op; map to an onnxscript function for anything else."
                )
            known = set(onnx.defs.get_schema(mapped, self.opset).attributes)
        elif isinstance(mapped, OnnxFunction):
            proto = mapped.to_function_proto()
            known = {*proto.attribute, *(a.name for a in proto.attribute_proto)}
            ident = (proto.domain, proto.name, proto.overload)
            if ident not in self.functions:
                self.functions[ident] = ir.serde.deserialize_function(proto)
        else:
            return
        for arg, value in args:
            if tensor_arity(arg) is None and value is not None and arg.name not in known:
                raise OnnxExportError(
                    f"torch_opaque.onnx: {qual} has argument '{arg.name}', which ONNX "
                    f"{getattr(mapped, 'name', mapped)} has no attribute for (it has: "
                    f"{', '.join(sorted(known)) or 'none'}). Map {qual} to an onnxscript "
                    f"function with that attribute."
                )

    def _check_training(self, fx_node: torch.fx.Node, info: OpaqueInfo) -> None:
        """A Name_fwd / Name_bwd call (Note [ONNX export of training programs])."""
        qual = f"{info.qualified_name}_{info.role}"
        if info.qualified_name in self.mapping:
            raise OnnxExportError(
                f"torch_opaque.onnx: mapping names {info.qualified_name}, but this training "
                f"program calls its training forms {info.qualified_name}_fwd/_bwd, which keep "
                f"the Function's own forward and backward as ONNX functions. Drop it from "
                f"mapping= (or pass functions=False for bare custom nodes)."
            )
        _refuse_symbolic(
            bind_call(info.target, fx_node.args, fx_node.kwargs), qual, fx_node,
            "(e.g. a dynamic size the backward needs)",
            "Export the training step with static shapes.",
        )
        try:
            self.training.add(
                info.target, call_constants(info.target, fx_node.args, fx_node.kwargs), fx_node,
                info.role,
            )
        except ValueError as e:
            raise OnnxExportError(f"torch_opaque.onnx: {e}; ONNX export needs them alike.") from e

    def _training_translation(self, info: OpaqueInfo) -> Callable:
        target = info.target
        op_type = f"{info.name}_{info.role}"

        def translate(*args, **kwargs):
            inputs, attrs = split_call(target, args, kwargs)
            shape = self.training.get(target, call_constants(target, args, kwargs))
            n_main = len(target._schema.returns) - 1
            n = n_main + shape if info.role == "fwd" else len(shape)
            outs = record_node(info.namespace, op_type, CUSTOM_OPSET_VERSION, inputs, attrs, n)
            outs = list(outs) if n > 1 else [outs]
            self._emitted.append((outs[0].producer(), info))
            if info.role == "fwd":
                return [*outs[:n_main], ValueList(outs[n_main:])]
            grads = [ir.Value(name=f"{op_type}_no_grad_{i}") for i in range(len(args[2]))]
            for pos, value in zip(shape, outs):
                grads[pos] = value
            return grads

        return translate

    def _translation(self, info: OpaqueInfo) -> Callable:
        """The custom_translation_table entry of an opaque op."""
        if info.role != "op":
            return self._training_translation(info)
        mapped, target = self.mapping.get(info.qualified_name), info.target
        if callable(mapped) and not isinstance(mapped, OnnxFunction):
            return mapped
        n_out = len(target._schema.returns)

        def translate(*args, **kwargs):
            inputs, attrs = split_call(target, args, kwargs)
            if isinstance(mapped, str):
                op = getattr(Opset("", self.opset), mapped)
                return op(*(v for _, v in inputs), **{a.name: a.value for a in attrs})
            if isinstance(mapped, OnnxFunction):
                return record_node(mapped.opset.domain, mapped.name, mapped.opset.version,
                             inputs, attrs, n_out)
            outs = record_node(info.namespace, info.name, CUSTOM_OPSET_VERSION, inputs, attrs, n_out)
            self._emitted.append(((outs[0] if n_out > 1 else outs).producer(), info))
            return outs

        return translate


def _refuse_list_results(info: OpaqueInfo) -> None:
    """A C++ op returning ``Tensor[]`` has one ONNX output per element, which
    its custom node cannot declare yet."""
    returns = info.overload_of("op")._schema.returns
    if any(isinstance(r.type, torch.ListType) for r in returns):
        raise OnnxExportError(
            f"torch_opaque.onnx: {info.qualified_name} returns Tensor[], whose elements its ONNX "
            f"node cannot declare as outputs, so it gets no ONNX function. Pass functions=False "
            f"to keep a bare custom node (onnxruntime then needs a custom-op kernel for it), or "
            f"mapping={{'{info.qualified_name}': <translation function>}}."
        )


def _refuse_symbolic(args: list, qual: str, fx_node, example: str, advice: str) -> None:
    """Non-tensor arguments become ONNX attributes, which are constants."""
    for arg, value in args:
        values = value if isinstance(value, (list, tuple)) else [value]
        if tensor_arity(arg) is None and any(isinstance(v, torch.fx.Node) for v in values):
            raise OnnxExportError(
                f"torch_opaque.onnx: argument '{arg.name}' of {qual} is a symbolic value at "
                f"{fx_node.name} {example}, but ONNX attributes are constants. {advice}"
            )
