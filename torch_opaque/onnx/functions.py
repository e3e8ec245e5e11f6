"""The ONNX functions of opaque calls: the user's forward (or, in training
programs, ``Name_fwd`` / ``Name_bwd``) of each kind of call traced to ATen
(Note [Tracing a call kind to ATen] in torch_opaque/_impl/tracing.py) and
exported by the same exporter, as a model-local function the node calls
(Note [ONNX export of opaque ops] in torch_opaque/onnx/__init__.py)."""

from __future__ import annotations

import hashlib

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
import torch

from .._impl.cpp_kernels import CppBackward, CppRunner
from .._impl.kernels import BackwardRunner
from .._impl.tracing import BackwardTrace, CallTemplate, ForwardTrace, size_hint, trace_to_aten
from ..errors import OnnxExportError
from ..ops import OpaqueInfo
from .nodes import bind_call, static_size, tensor_arity


def add_functions(model: ir.Model, functions: dict) -> None:
    for fn in functions.values():
        model.functions[fn.identifier()] = fn
        for domain, version in fn.opset_imports.items():
            model.opset_imports.setdefault(domain, version)



class FunctionBodies:
    """The exporter's function bodies; needs ``to_ir`` and ``functions``."""

    # ---- the function body of one call --------------------------------------------------

    def _function_for(self, node: ir.Node, info: OpaqueInfo) -> str:
        """Make (or reuse) the function for this call; returns its overload."""
        fx_node = node.meta.get("node")  # set by torch.onnx on the nodes it records
        if not isinstance(fx_node, torch.fx.Node):
            raise OnnxExportError(
                f"torch_opaque.onnx: cannot find the FX call of {info.qualified_name} behind ONNX "
                f"node {node.name} (the torch.onnx exporter changed?). Pass functions=False."
            )
        template, fakes, key, names = [], [], [], []
        for arg, value in bind_call(info.target, fx_node.args, fx_node.kwargs):
            kind = tensor_arity(arg)
            if kind == "list" and value is not None and any(v is None for v in value):
                template.append(("O", [v is None for v in value]))
                names += [f"{arg.name}_{i}" for i in range(len(value))]
                for v in value:
                    if v is not None:
                        fakes.append(v.meta["val"])
                        key.append((str(fakes[-1].dtype), [static_size(s) for s in fakes[-1].shape]))
                    else:
                        key.append(None)
                continue
            if kind is None or value is None:
                template.append(("C", value) if kind is None else ("N",))
                names += [] if kind is None else [arg.name]
                key.append(repr(value))
                continue
            vals = [value] if kind == "one" else list(value)
            template.append(("T",) if kind == "one" else ("L", len(vals)))
            names += [arg.name] if kind == "one" else [f"{arg.name}_{i}" for i in range(len(vals))]
            for v in vals:
                fake = v.meta["val"]
                fakes.append(fake)
                key.append((str(fake.dtype), [static_size(s) for s in fake.shape]))
        digest = hashlib.sha1(repr((info.target.name(), key)).encode()).hexdigest()[:8]
        overload = f"{info.overload}_{digest}"
        ident = (info.namespace, node.op_type, overload)
        if ident not in self.functions:
            body = self._body_module(info, template, fx_node)
            model = self._body_to_ir(info, self._trace_body(info, body, fakes))
            # onnxruntime ignores the overload of calls made inside a function:
            # inline the functions the body calls.
            add_functions(model, self.functions)
            ir_passes.InlinePass()(model)
            model.functions.clear()
            self.functions[ident] = _to_function(model, ident, node, template, names)
        return overload

    def _body_to_ir(self, info: OpaqueInfo, body: torch.export.ExportedProgram) -> ir.Model:
        """The traced forward as ONNX; a forward torch.onnx cannot translate (an SVD,
        say) is an error that names the Function and the ways out."""
        try:
            return self.to_ir(body)
        except OnnxExportError:
            raise
        except Exception as e:
            qual = info.qualified_name
            cause = _onnx_cause(e)
            if info.role != "op":
                raise OnnxExportError(
                    f"torch_opaque.onnx: the {_part(info)} of {qual} "
                    f"({_origin(info)}) has no ONNX translation ({cause}), so the "
                    f"ONNX function of {qual}_{info.role} in this training program cannot be "
                    f"built. {_training_advice(qual)}"
                ) from e
            raise OnnxExportError(
                f"torch_opaque.onnx: the forward of {qual} ({_origin(info)}) has "
                f"no ONNX translation ({cause}), so its ONNX function cannot be built. Pass "
                f"mapping={{'{qual}': <ONNX op name or onnxscript function>}}{_by_class(info)} "
                f"to translate the op yourself, or "
                f"functions=False to keep a bare custom node (onnxruntime then needs a "
                f"custom-op kernel for it)."
            ) from e

    def _body_module(self, info: OpaqueInfo, template: list, fx_node) -> torch.nn.Module:
        """The call's body: its forward (Note [Tracing a call kind to ATen]; a
        ``Name_fwd`` call's needs_input_grad is its last argument, so outputs
        and residuals), or a ``Name_bwd`` call's backward."""
        call = CallTemplate(template)
        ov = info.python_overload
        if ov is None:  # an op defined in C++: its own kernels (Note [Kernels below autograd])
            runner = CppRunner(info.namespace, info.name, info.overload)
            backward = CppBackward(info.namespace, info.name, info.overload)
        else:
            runner = ov.runner
            python_backward = BackwardRunner(info.function.display_name,
                                             info.function.cls.backward, ov.specs)
            backward = lambda *a: python_backward(*a)[0]  # noqa: E731
        if info.role == "bwd":
            positions = tuple(i for i, g in enumerate(fx_node.meta["val"]) if g is not None)
            return BackwardTrace(backward, call, positions)
        return ForwardTrace(runner, call)

    def _trace_body(self, info: OpaqueInfo, body, fakes) -> torch.export.ExportedProgram:
        qual = info.qualified_name
        examples = [
            torch.zeros([size_hint(s) for s in f.shape], dtype=f.dtype, device=f.device)
            for f in fakes
        ]
        dynamic = [
            {d: torch.export.Dim.AUTO for d, s in enumerate(f.shape) if static_size(s) is None}
            or None
            for f in fakes
        ]
        advice = _training_advice(qual) if info.role != "op" else (
            f"Pass mapping={{'{qual}': <ONNX op name or onnxscript function>}} to export it "
            f"another way, or functions=False to keep a bare custom node (no ONNX function; "
            f"onnxruntime then needs a custom-op kernel for it)."
        )
        try:
            body = trace_to_aten(body, examples, dynamic)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise OnnxExportError(
                f"torch_opaque.onnx: the {_part(info)} of {qual} ({_origin(info)}) "
                f"cannot be traced to ATen ops for its ONNX function ({type(e).__name__}: {first}). "
                f"{_cpp_hint(info)}{advice}"
            ) from e
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for k, (f, p) in enumerate(zip(fakes, placeholders)):
            for d, s in enumerate(f.shape):
                if static_size(s) is None and static_size(p.meta["val"].shape[d]) is not None:
                    raise OnnxExportError(
                        f"torch_opaque.onnx: the {_part(info)} of {qual} specialises dimension {d} of "
                        f"tensor input {k}, which is dynamic where the op is called; its ONNX "
                        f"function would be wrong for other sizes. {advice}"
                    )
        return body


def _origin(info: OpaqueInfo) -> str:
    return "defined in C++" if info.function is None else info.function.display_name


def _by_class(info: OpaqueInfo) -> str:
    if info.function is None:
        return ""
    return f" (or mapping={{{info.function.display_name}: ...}})"


def _cpp_hint(info: OpaqueInfo) -> str:
    if info.function is not None:
        return ""
    return ("A C++ op's kernels become ONNX functions only when they are made of ATen ops "
            "(not loops over data_ptr, say). ")


def _part(info: OpaqueInfo) -> str:
    return "backward" if info.role == "bwd" else "forward"


def _training_advice(qual: str) -> str:
    return (
        f"Pass functions=False to keep bare custom nodes (no ONNX functions; onnxruntime then "
        f"needs custom-op kernels for {qual}_fwd and {qual}_bwd); mapping= translates only the "
        f"inference op {qual}, so export the inference program (torch.export.export) with "
        f"mapping={{'{qual}': ...}} to translate it yourself."
    )


def _onnx_cause(e: BaseException) -> str:
    """The innermost reason torch.onnx gives (e.g. "No ONNX function found for
    <OpOverload(op='aten._linalg_svd', ...)>"), in one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def _to_function(model: ir.Model, ident: tuple, node: ir.Node, template: list, names: list
                 ) -> ir.Function:
    """An exported body as a model-local function with the call's interface:
    one input per node input (an unused one for None), the node's attributes
    declared with their values as defaults."""
    graph = model.graph
    ir_passes.OutputFixPass()(model)  # no graph input as output, no output twice
    consts = []
    for name, init in list(graph.initializers.items()):  # functions have no initializers
        const = ir.node("Constant", [], {"value": init.const_value})
        graph.initializers.pop(name)
        init.replace_all_uses_with(const.outputs[0], replace_graph_outputs=True)
        const.outputs[0].name = name
        consts.append(const)
    if consts:
        graph.insert_before(graph.node(0), consts) if len(graph) else graph.extend(consts)
    body_inputs = iter(list(graph.inputs))
    graph.inputs.clear()
    for i, t in enumerate(template):
        if t[0] == "T":
            graph.inputs.append(next(body_inputs))
        elif t[0] == "L":
            graph.inputs.extend(next(body_inputs) for _ in range(t[1]))
        elif t[0] == "N":
            graph.inputs.append(ir.Value(name=f"unused_input_{i}"))
        elif t[0] == "O":
            graph.inputs.extend(
                ir.Value(name=f"unused_input_{i}_{j}") if none else next(body_inputs)
                for j, none in enumerate(t[1])
            )
    taken = {v.name for n in graph for v in n.outputs}
    for value, name in zip(graph.inputs, names):
        if name not in taken:
            value.name = name  # the node's formal names instead of tensors_0, ...
    for value in (*graph.inputs, *(o for n in graph for o in n.outputs)):
        value.shape = None  # the body's symbolic sizes mean nothing at the call site
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    return ir.Function(*ident, graph=graph, attributes=attributes)
