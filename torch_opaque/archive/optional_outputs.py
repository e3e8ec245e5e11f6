"""Writing the ``Tensor?[]`` result of ``Name_bwd`` calls into a .pt2 archive.

Note [Serializing Tensor?[] results]
A training program (``torch_opaque.export_training``) calls ``Name_bwd``, whose
schema returns ``Tensor?[]``: one gradient per forward argument, ``None`` where
an argument gets none (a float argument, an input that needs no gradient).
torch's serializer (torch/_export/serde/serialize.py,
``GraphModuleSerializer.serialize_outputs``) writes a single list result only
when its elements are ``Tensor``; for ``Tensor?[]`` it raises
``SerializeError: Unable to serialize output``. Its *deserializer* already reads
what such a result needs, both forms being ones it writes for other ops:

* no ``None`` in the list: one ``as_tensors`` output, as for a ``Tensor[]``
  result (read back as one ``getitem`` per element);
* some ``None``: one output per element, ``as_tensor`` or ``as_none``, as for a
  ``(Tensor, Tensor?)`` tuple result (read back as one ``getitem`` per element,
  the ``None`` ones giving ``None``).

While :func:`optional_tensor_list_results` is active, the serializer writes
``Tensor?[]`` results that way and leaves every other node to torch's code.
The archive stays a plain pt2 archive: ``torch.export.load`` and
``torch_opaque.load`` read it without help, and the loaded graph has the same
``getitem`` users as the saved one. (A single-element list holding ``None`` is
written as a ``None`` result: no node can use that element.)
"""

from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.Lock()
_PATCHES: dict = {}  # attribute -> [users, original]


def _returns_optional_tensor_list(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    if len(returns) != 1:
        return False
    t = returns[0].real_type
    return (
        isinstance(t, torch.ListType)
        and isinstance(t.getElementType(), torch.OptionalType)
        and isinstance(t.getElementType().getElementType(), torch.TensorType)
    )


def _serialize_optional_list(self, node, Argument) -> list:
    values = list(node.meta["val"])
    if all(isinstance(v, torch.Tensor) for v in values):
        return [
            Argument.create(
                as_tensors=[
                    self.serialize_tensor_output(self._output_node_name_at_index(node, i), v)
                    for i, v in enumerate(values)
                ]
            )
        ]
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(Argument.create(as_none=True))
        else:
            name = self._output_node_name_at_index(node, i)
            out.append(Argument.create(as_tensor=self.serialize_tensor_output(name, v)))
    return out


@contextlib.contextmanager
def serializer_patch(attr: str, make):
    """While active, torch's ``GraphModuleSerializer.<attr>`` is ``make(original)``.
    Reentrant and thread-safe: each patch is installed once and removed by its
    last user (also used by Note [Higher-order ops in archives], hop_forms.py)."""
    from torch._export.serde import serialize as serde

    cls = serde.GraphModuleSerializer
    with _LOCK:
        entry = _PATCHES.get(attr)
        if entry is None:
            original = cls.__dict__[attr]
            entry = _PATCHES[attr] = [0, original]
            setattr(cls, attr, make(original))
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                setattr(cls, attr, entry[1])
                del _PATCHES[attr]


def _optional_list_outputs(original):
    from torch._export.serde.schema import Argument

    def serialize_outputs(self, node):
        if node.op == "call_function" and _returns_optional_tensor_list(node.target) and (
            isinstance(node.meta.get("val"), (list, tuple))
        ):
            return _serialize_optional_list(self, node, Argument)
        return original(self, node)

    return serialize_outputs


def optional_tensor_list_results():
    """While active, torch's graph serializer writes ``Tensor?[]`` op results
    (Note [Serializing Tensor?[] results])."""
    return serializer_patch("serialize_outputs", _optional_list_outputs)
