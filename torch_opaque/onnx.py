"""Exporting models with opaque ops to ONNX: one custom node per op call.

Example::

    >>> import numpy as np, onnxruntime, torch, torch_opaque, torch_opaque.onnx
    >>> @torch_opaque.op(name="OnnxDocFoo")
    ... class Foo(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x, scale: float = 2.0):
    ...         ctx.save_for_backward(x)
    ...         return x.sin() * scale
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         (x,) = ctx.saved_tensors
    ...         return grad * x.cos() * 2.0, None
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Foo.apply(x, 3.0) + 1
    >>> batch = torch.export.Dim("batch")
    >>> proto = torch_opaque.onnx.export(M(), (torch.randn(4, 3),),
    ...                                  dynamic_shapes=({0: batch},))
    >>> [(n.domain, n.op_type) for n in proto.graph.node]
    [('opaque', 'OnnxDocFoo'), ('', 'Add')]
    >>> proto.graph.node[0].attribute[0].name, proto.graph.node[0].attribute[0].f
    ('scale', 3.0)
    >>> [(f.domain, f.name, [n.op_type for n in f.node]) for f in proto.functions]
    [('opaque', 'OnnxDocFoo', ['Constant', 'Sin', 'Mul'])]
    >>> x = torch.randn(7, 3)
    >>> sess = onnxruntime.InferenceSession(proto.SerializeToString())
    >>> (y,) = sess.run(None, {"x": x.numpy()})
    >>> bool(np.allclose(y, M()(x).numpy(), atol=1e-6))
    True

Note [ONNX export of opaque ops]
The model goes through ``torch.export`` (non-strict) and then
``torch.onnx.export(..., dynamo=True)`` with a ``custom_translation_table``
entry for every opaque op in the graph (found with ``torch_opaque.ops``):

* Each call becomes one node in the domain named after the op's namespace,
  ``op_type`` = the op name. Tensor arguments are its inputs (a ``Tensor[]``
  spreads over consecutive inputs ``xs_0, xs_1, ...``; ``None`` is an empty
  input), every other argument is an attribute named like the forward's
  parameter (float, int, string, lists; a dtype is its ONNX type number, a
  bool an int). The node is made by calling an onnxscript ``Op`` built on an
  ``onnx.defs.OpSchema`` for the op, which is how onnxscript custom-opset calls
  get their attributes.
* ``functions=True`` adds a model-local function per distinct call: the user's
  forward traced to ATen (``torch.export`` of a module that calls the
  overload's ``runner``) and exported by the same machinery (so opaque ops
  inside a forward work too). The trace sees the attribute values as Python
  numbers, so they are baked into the body: the function is specialised per
  call and told apart by the ONNX ``overload`` field (IR >= 10). Node
  ``opaque::Foo`` with ``overload="Tensor_float_1a2b3c4d"`` calls function
  ``(opaque, Foo, Tensor_float_1a2b3c4d)``, which declares the node's
  attributes (their values as defaults). Calls with equal attributes, input
  dtypes and static sizes share a function. Sizes symbolic at the call site are
  dynamic in the trace; a forward that specialises one is refused. onnxruntime
  ignores the overload of calls made inside a function, so the functions a body
  calls are inlined into it.
* ``mapping`` replaces the custom node by a standard ONNX op (the op's
  non-tensor arguments must be attributes of it), by a call of an onnxscript
  function (added to the model's functions; arguments must be its attributes),
  or by any other translation callable, which torch.onnx then calls like its
  own. ``inline=True`` inlines every model-local function (onnx_ir
  ``InlinePass``); unused functions and opset imports are dropped.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from typing import Callable, Optional

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
import torch
from onnx.defs import OpSchema
from onnxscript.values import OnnxFunction, Op, Opset
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ._impl.function import lookup
from ._impl.calls import NEEDS_INPUT_GRAD, bind, tensor_kind
from ._impl.tracing import size_hint
from .ops import OpaqueInfo, opaque_nodes
from .onnx_training import BackwardBody, ForwardBody, TrainingCalls, ValueList, with_user_outputs

__all__ = ["export", "OnnxExportError"]

CUSTOM_OPSET_VERSION = 1
_TYPES = [f"tensor({t})" for t in (
    "float double float16 bfloat16 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "bool string complex64 complex128").split()]


class OnnxExportError(RuntimeError):
    """An opaque op that cannot be exported as asked; the message says what to pass."""


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
    with _reuse_torchlib_registry():
        model = exporter.to_ir(ep, top=True)
    _add_functions(model, exporter.functions)
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


def _add_functions(model: ir.Model, functions: dict) -> None:
    for fn in functions.values():
        model.functions[fn.identifier()] = fn
        for domain, version in fn.opset_imports.items():
            model.opset_imports.setdefault(domain, version)


# Note [Registry reuse]: every torch.onnx.export call rebuilds the torchlib
# registry (~4 s: onnxscript re-parses ~500 functions), and one export here makes
# 1 + (number of function bodies) of them. While export() runs, from_torchlib
# hands out copies of one build per opset instead. Should the exporter's
# internals change, the original from_torchlib is used.
_REGISTRIES: dict = {}
_REGISTRY_LOCK = threading.Lock()
_REGISTRY_USERS = [0]


@contextlib.contextmanager
def _reuse_torchlib_registry():
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
        default_opset = _registration._constants.TORCHLIB_OPSET
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(klass, opset_version=default_opset):
        base = _REGISTRIES.get(opset_version)
        if base is None:
            base = original.__func__(klass, opset_version)
            if not isinstance(getattr(base, "functions", None), dict):
                return base
            _REGISTRIES[opset_version] = base
        registry = copy.copy(base)  # translations get registered into the copy
        registry.functions = {k: list(v) for k, v in base.functions.items()}
        return registry

    with _REGISTRY_LOCK:
        _REGISTRY_USERS[0] += 1
        cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        with _REGISTRY_LOCK:
            _REGISTRY_USERS[0] -= 1
            if not _REGISTRY_USERS[0]:
                cls.from_torchlib = original


# ---- arguments ------------------------------------------------------------------------


def _tensor_kind(arg) -> Optional[str]:
    """"one" / "list" for the schema types Tensor(?) / Tensor[] (or Tensor?[]), else None."""
    return {"tensor": "one", "tensors": "list"}.get(tensor_kind(arg))


def _bind(target, args, kwargs) -> list:
    """(schema argument, value) for every argument of a call. ``Name_fwd`` /
    ``Name_bwd`` calls (training programs) bind every argument by position,
    needs_input_grad included (an attribute of their ONNX nodes)."""
    schema = target._schema
    if all(a.name != NEEDS_INPUT_GRAD for a in schema.arguments):
        return bind(schema, args, kwargs)
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out.append((a, args[i]))
        elif a.name in kwargs:
            out.append((a, kwargs[a.name]))
        elif a.has_default_value():
            out.append((a, a.default_value))
    return out


def _constants(target, args, kwargs) -> tuple:
    """The non-tensor arguments of a call, as plain nested tuples (a call kind)."""
    def plain(v):
        return tuple(plain(x) for x in v) if isinstance(v, (list, tuple)) else v

    return tuple(
        (a.name, plain(v)) for a, v in _bind(target, args, kwargs) if _tensor_kind(a) is None
    )


def _attribute(arg, value) -> Optional[ir.Attr]:
    """A non-tensor argument as a typed ONNX attribute (None: no attribute)."""
    t = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return ir.AttrInt64(arg.name, int(ir.tensor_adapters.from_torch_dtype(value)))
    if isinstance(value, (torch.device, str)):
        return ir.AttrString(arg.name, str(value))
    if isinstance(t, torch.FloatType):
        return ir.AttrFloat32(arg.name, float(value))
    if isinstance(t, torch.ListType):
        if isinstance(t.getElementType(), torch.FloatType):
            return ir.AttrFloat32s(arg.name, [float(v) for v in value])
        return ir.AttrInt64s(arg.name, [int(v) for v in value])
    return ir.AttrInt64(arg.name, int(value))  # int, SymInt, bool


def _split(target, args, kwargs) -> tuple:
    """The call's (name, tensor) inputs and its attributes."""
    inputs, attrs = [], []
    for arg, value in _bind(target, args, kwargs):
        kind = _tensor_kind(arg)
        if kind == "list":
            inputs += [(f"{arg.name}_{i}", v) for i, v in enumerate(value)]
        elif kind == "one":
            inputs.append((arg.name, value))
        elif (attr := _attribute(arg, value)) is not None:
            attrs.append(attr)
    return inputs, attrs


def _call(domain: str, name: str, version: int, inputs: list, attrs: list, n_out: int):
    """Record one node ``domain::name`` in the graph torch.onnx is building."""
    schema = OpSchema(
        name, domain, version,
        inputs=[OpSchema.FormalParameter(n, f"T{i}", param_option=OpSchema.
                                         FormalParameterOption.Optional)
                for i, (n, _) in enumerate(inputs)],
        outputs=[OpSchema.FormalParameter(f"out{k}", f"O{k}") for k in range(n_out)],
        type_constraints=[(f"T{i}", _TYPES, "") for i in range(len(inputs))]
        + [(f"O{k}", _TYPES, "") for k in range(n_out)],
        attributes=[OpSchema.Attribute(a.name, OpSchema.AttrType[a.type.name], "",
                                       required=False) for a in attrs],
    )
    op = Op(Opset(domain, version), name, schema)
    return op(*(v for _, v in inputs), **{a.name: a for a in attrs})


def _static(size) -> Optional[int]:
    """The size as an int, None when it is symbolic."""
    return int(size) if is_concrete_int(size) else None


def _rebuild(template: list, tensors) -> list:
    """A call's arguments from its body's tensor inputs. ``template`` per
    argument: ("T",) a tensor, ("L", n) n tensors, ("O", nones) a Tensor?[]
    (None where ``nones`` says), ("N",) a None tensor, ("C", value) a constant."""
    it = iter(tensors)
    return [
        next(it) if t[0] == "T" else [next(it) for _ in range(t[1])] if t[0] == "L"
        else [None if none else next(it) for none in t[1]] if t[0] == "O"
        else None if t[0] == "N" else t[1]
        for t in template
    ]


class _Body(torch.nn.Module):
    """The user's forward for one call: tensors in, outputs out."""

    def __init__(self, ov, template: list):
        super().__init__()
        self.ov, self.template = ov, template

    def forward(self, *tensors):
        args = _rebuild(self.template, tensors)
        # The bridge's run already copies outputs that alias inputs.
        outs, _residuals, _record = self.ov.runner.run(None, args)
        return tuple(outs)


# ---- the exporter ------------------------------------------------------------------------


class _Exporter:
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
        if info.role != "op":
            self._check_training(fx_node, info)
            return
        if callable(mapped) and not isinstance(mapped, OnnxFunction):
            return  # a translation function: torch.onnx calls it with the node's arguments
        args = _bind(info.target, fx_node.args, fx_node.kwargs)
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
        elif self.with_functions and info.python_overload is None:
            raise OnnxExportError(
                f"torch_opaque.onnx: {qual} is defined in C++, so there is no Python forward to "
                f"turn into an ONNX function. Pass mapping={{'{qual}': <ONNX op name or "
                f"onnxscript function>}}, or functions=False for a bare custom node."
            )
        else:
            return
        for arg, value in args:
            if _tensor_kind(arg) is None and value is not None and arg.name not in known:
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
        if self.with_functions and info.python_overload is None:
            raise OnnxExportError(
                f"torch_opaque.onnx: {qual} belongs to an op defined in C++, so there is no "
                f"Python forward/backward to turn into an ONNX function. Pass functions=False "
                f"for bare custom nodes."
            )
        _refuse_symbolic(
            _bind(info.target, fx_node.args, fx_node.kwargs), qual, fx_node,
            "(e.g. a dynamic size the backward needs)",
            "Export the training step with static shapes.",
        )
        try:
            self.training.add(
                info.target, _constants(info.target, fx_node.args, fx_node.kwargs), fx_node,
                info.role,
            )
        except ValueError as e:
            raise OnnxExportError(f"torch_opaque.onnx: {e}; ONNX export needs them alike.") from e

    def _training_translation(self, info: OpaqueInfo) -> Callable:
        target = info.target
        op_type = f"{info.name}_{info.role}"

        def translate(*args, **kwargs):
            inputs, attrs = _split(target, args, kwargs)
            shape = self.training.get(target, _constants(target, args, kwargs))
            n_main = len(target._schema.returns) - 1
            n = n_main + shape if info.role == "fwd" else len(shape)
            outs = _call(info.namespace, op_type, CUSTOM_OPSET_VERSION, inputs, attrs, n)
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
            inputs, attrs = _split(target, args, kwargs)
            if isinstance(mapped, str):
                op = getattr(Opset("", self.opset), mapped)
                return op(*(v for _, v in inputs), **{a.name: a.value for a in attrs})
            if isinstance(mapped, OnnxFunction):
                return _call(mapped.opset.domain, mapped.name, mapped.opset.version,
                             inputs, attrs, n_out)
            outs = _call(info.namespace, info.name, CUSTOM_OPSET_VERSION, inputs, attrs, n_out)
            self._emitted.append(((outs[0] if n_out > 1 else outs).producer(), info))
            return outs

        return translate

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
        for arg, value in _bind(info.target, fx_node.args, fx_node.kwargs):
            kind = _tensor_kind(arg)
            if kind == "list" and value is not None and any(v is None for v in value):
                template.append(("O", [v is None for v in value]))
                names += [f"{arg.name}_{i}" for i in range(len(value))]
                for v in value:
                    if v is not None:
                        fakes.append(v.meta["val"])
                        key.append((str(fakes[-1].dtype), [_static(s) for s in fakes[-1].shape]))
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
                key.append((str(fake.dtype), [_static(s) for s in fake.shape]))
        digest = hashlib.sha1(repr((info.target.name(), key)).encode()).hexdigest()[:8]
        overload = f"{info.overload}_{digest}"
        ident = (info.namespace, node.op_type, overload)
        if ident not in self.functions:
            body = self._body_module(info, template, fx_node)
            model = self._body_to_ir(info, self._trace_body(info, body, fakes))
            # onnxruntime ignores the overload of calls made inside a function:
            # inline the functions the body calls.
            _add_functions(model, self.functions)
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
                    f"({info.function.display_name}) has no ONNX translation ({cause}), so the "
                    f"ONNX function of {qual}_{info.role} in this training program cannot be "
                    f"built. {_training_advice(qual)}"
                ) from e
            raise OnnxExportError(
                f"torch_opaque.onnx: the forward of {qual} ({info.function.display_name}) has "
                f"no ONNX translation ({cause}), so its ONNX function cannot be built. Pass "
                f"mapping={{'{qual}': <ONNX op name or onnxscript function>}} (or mapping="
                f"{{{info.function.display_name}: ...}}) to translate the op yourself, or "
                f"functions=False to keep a bare custom node (onnxruntime then needs a "
                f"custom-op kernel for it)."
            ) from e

    def _body_module(self, info: OpaqueInfo, template: list, fx_node) -> torch.nn.Module:
        ov = info.python_overload
        if info.role == "fwd":
            return ForwardBody(ov, template, _rebuild)
        if info.role == "bwd":
            positions = tuple(i for i, g in enumerate(fx_node.meta["val"]) if g is not None)
            return BackwardBody(info.function, ov, template, _rebuild, positions)
        return _Body(ov, template)

    def _trace_body(self, info: OpaqueInfo, body, fakes) -> torch.export.ExportedProgram:
        qual = info.qualified_name
        examples = tuple(
            torch.zeros([size_hint(s) for s in f.shape], dtype=f.dtype, device=f.device)
            for f in fakes
        )
        dynamic = tuple(
            {d: torch.export.Dim.AUTO for d, s in enumerate(f.shape) if _static(s) is None}
            or None
            for f in fakes
        )
        advice = _training_advice(qual) if info.role != "op" else (
            f"Pass mapping={{'{qual}': <ONNX op name or onnxscript function>}} to export it "
            f"another way, or functions=False to keep a bare custom node (no ONNX function; "
            f"onnxruntime then needs a custom-op kernel for it)."
        )
        try:
            body = torch.export.export(
                body, examples,
                dynamic_shapes={"tensors": dynamic}, strict=False,
            )
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise OnnxExportError(
                f"torch_opaque.onnx: the {_part(info)} of {qual} ({info.function.display_name}) "
                f"cannot be traced to ATen ops for its ONNX function ({type(e).__name__}: {first}). "
                f"{advice}"
            ) from e
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for k, (f, p) in enumerate(zip(fakes, placeholders)):
            for d, s in enumerate(f.shape):
                if _static(s) is None and _static(p.meta["val"].shape[d]) is not None:
                    raise OnnxExportError(
                        f"torch_opaque.onnx: the {_part(info)} of {qual} specialises dimension {d} of "
                        f"tensor input {k}, which is dynamic where the op is called; its ONNX "
                        f"function would be wrong for other sizes. {advice}"
                    )
        return body


def _refuse_symbolic(args: list, qual: str, fx_node, example: str, advice: str) -> None:
    """Non-tensor arguments become ONNX attributes, which are constants."""
    for arg, value in args:
        values = value if isinstance(value, (list, tuple)) else [value]
        if _tensor_kind(arg) is None and any(isinstance(v, torch.fx.Node) for v in values):
            raise OnnxExportError(
                f"torch_opaque.onnx: argument '{arg.name}' of {qual} is a symbolic value at "
                f"{fx_node.name} {example}, but ONNX attributes are constants. {advice}"
            )


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
