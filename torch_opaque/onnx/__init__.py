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
  overload's ``runner``; for an op defined in C++, its own kernel run below
  autograd, Note [Kernels below autograd] in csrc/python/kernel_below_autograd.h)
  and exported by the same machinery (so opaque ops inside a forward work too). The trace sees the attribute values as Python
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
* ``torch.onnx.export(model, args, dynamo=True)`` itself translates opaque ops
  the same way (Note [torch.onnx.export of opaque ops] in torch_onnx_export.py),
  but inlines every function: its model holds the forwards' bodies.
"""

from __future__ import annotations

from ..errors import OnnxExportError
from .exporter import export
from .nodes import CUSTOM_OPSET_VERSION

__all__ = ["export", "OnnxExportError", "CUSTOM_OPSET_VERSION"]
