"""Higher-order operators in saved programs, written in forms that load back.

Note [Higher-order ops in archives]
torch.export puts a higher-order operator (HOP) in a program wherever the
traced code switches a mode or branches: ``wrap_with_set_grad_enabled``
(``torch.no_grad()``, ``set_grad_enabled``, ``enable_grad``),
``wrap_with_autocast``, ``cond``, ``while_loop``, ``map_impl``. The forward and
backward a self-contained archive stores are traced by torch.export, so every
such region of a Function lands in a stored program. torch's serializer
(torch/_export/serde/serialize.py) writes a HOP call as its target, its
arguments (each subgraph an ``as_graph`` argument) and the results its
``meta["val"]`` describes; the deserializer builds one ``getitem`` per result
and gives the call the ``val`` of those, and the verifier wants a ``val`` on
every call. What torch 2.13 cannot carry, and what torch_opaque does:

* a region that returns nothing (``val == ()``). torch writes no result, its
  deserializer then sets no ``val`` and the verifier refuses the program
  (``SpecViolationError: Node.meta wrap_with_set_grad_enabled is missing val
  field``): torch.export.save writes an archive that torch.export.load refuses.
  torch.export makes such regions from ``with torch.set_grad_enabled(False):``
  (the constructor switches the mode already: an empty region comes before the
  one with the body), from a grad-mode block inside an autocast block (an empty
  autocast region), and from a region none of whose values are used. While
  torch_opaque saves (:func:`serializer_forms`), the results of such a call are
  written as one ``None``, the form torch writes for an op that returns None;
  torch's deserializer reads it as ``val = None``, the call still runs (and
  returns ``()``), nothing uses it, and writing the loaded program again gives
  the same form. torch.export.load reads these archives too. Loading also
  reads archives written without it (by torch.export.save or an earlier
  torch_opaque): :func:`read_empty_results` gives a HOP call with no results
  that one ``None`` result before torch's deserializer sees it.
* a Python int carried by ``while_loop`` (``while_loop(cond, body, (0, x))``):
  torch cannot write a list that mixes ints and tensors (``SerializeError:
  Unsupported list/tuple argument type``), so saving fails, naming the program
  and the fix: carry a tensor (``torch.tensor(0)``).

Everything else (``cond``, ``while_loop`` over tensors, ``map_impl``, nested
regions, opaque ops inside subgraphs) torch writes and reads itself; whatever
the form, ``save`` reads back what it wrote before keeping it (Note [Saving
reads back what it wrote] in readback.py).
"""

from __future__ import annotations

import contextlib

from .optional_outputs import optional_tensor_list_results, serializer_patch

HOP_PREFIX = "torch.ops.higher_order."


def _empty_results_as_none(original):
    from torch._export.serde.schema import Argument

    def serialize_hoo_outputs(self, node):
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)) and len(val) == 0:
            return [Argument.create(as_none=True)]
        return original(self, node)

    return serialize_hoo_outputs


@contextlib.contextmanager
def serializer_forms():
    """While active, torch's serializer writes what it cannot carry by itself in
    forms its deserializer reads: ``Tensor?[]`` results (Note [Serializing
    Tensor?[] results]) and HOP calls that return nothing (Note [Higher-order
    ops in archives])."""
    with optional_tensor_list_results(), serializer_patch("serialize_hoo_outputs", _empty_results_as_none):
        yield


def _graphs(graph):
    """A serialized graph and every graph nested in its HOP calls."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.nodes:
            for inp in node.inputs:
                arg = inp.arg
                if getattr(arg, "type", None) == "as_graph":
                    stack.append(arg.as_graph.graph)


def read_empty_results(program) -> int:
    """Gives every HOP call of a checked, serialized program (a
    ``torch._export.serde.schema.ExportedProgram``) that has no results one
    ``None`` result, the form :func:`serializer_forms` writes; returns how many
    were changed."""
    from torch._export.serde.schema import Argument

    changed = 0
    for graph in _graphs(program.graph_module.graph):
        for node in graph.nodes:
            if node.target.startswith(HOP_PREFIX) and not node.outputs:
                node.outputs = [Argument.create(as_none=True)]
                node.is_hop_single_tensor_return = False
                changed += 1
    return changed


def explain_serialize_error(e: Exception) -> str:
    """torch's serializer error, with the way out where torch_opaque knows one."""
    text = (str(e).strip().splitlines() or [type(e).__name__])
    first, last = text[0], text[-1]
    why = first if first == last else f"{first} ... {last}"
    if "while_loop" in str(e) and "Unsupported list/tuple argument type" in str(e):
        why += (
            " (a while_loop carries a Python int next to tensors, which torch's serializer "
            "cannot write: carry a tensor instead, e.g. torch.tensor(0) for a counter)"
        )
    return f"{type(e).__name__}: {why[:2000]}"
