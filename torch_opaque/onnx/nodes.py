"""One opaque call as one ONNX node: its tensor inputs, its other arguments
as typed attributes, and the node recorded through an onnxscript ``Op``
(Note [ONNX export of opaque ops] in torch_opaque/onnx/__init__.py).
"""

from __future__ import annotations

from typing import Optional

import onnx_ir as ir
import torch
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .._impl.calls import NEEDS_INPUT_GRAD, bind, tensor_kind

CUSTOM_OPSET_VERSION = 1
_TYPES = [f"tensor({t})" for t in (
    "float double float16 bfloat16 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "bool string complex64 complex128").split()]



def tensor_arity(arg) -> Optional[str]:
    """"one" / "list" for the schema types Tensor(?) / Tensor[] (or Tensor?[]), else None."""
    return {"tensor": "one", "tensors": "list"}.get(tensor_kind(arg))


def bind_call(target, args, kwargs) -> list:
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


def call_constants(target, args, kwargs) -> tuple:
    """The non-tensor arguments of a call, as plain nested tuples (a call kind)."""
    def plain(v):
        return tuple(plain(x) for x in v) if isinstance(v, (list, tuple)) else v

    return tuple(
        (a.name, plain(v)) for a, v in bind_call(target, args, kwargs) if tensor_arity(a) is None
    )


def attribute(arg, value) -> Optional[ir.Attr]:
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


def split_call(target, args, kwargs) -> tuple:
    """The call's (name, tensor) inputs and its attributes."""
    inputs, attrs = [], []
    for arg, value in bind_call(target, args, kwargs):
        kind = tensor_arity(arg)
        if kind == "list":
            inputs += [(f"{arg.name}_{i}", v) for i, v in enumerate(value)]
        elif kind == "one":
            inputs.append((arg.name, value))
        elif (attr := attribute(arg, value)) is not None:
            attrs.append(attr)
    return inputs, attrs


def record_node(domain: str, name: str, version: int, inputs: list, attrs: list, n_out: int):
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


def static_size(size) -> Optional[int]:
    """The size as an int, None when it is symbolic."""
    return int(size) if is_concrete_int(size) else None

