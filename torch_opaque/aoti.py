"""AOTInductor packages of programs that call opaque ops, training steps included.

``torch._inductor.aoti_compile_and_package`` runs opaque ops through its proxy
executor, which cannot return the ``Tensor?[]`` result of ``Name_bwd``. A
training program (:func:`torch_opaque.export_training`) is packaged after
:func:`for_aoti` has replaced each ``Name_bwd`` call by
``torch_opaque::call_bwd``, an op of torch_opaque's C++ core that calls
``Name_bwd`` and returns the gradients the traced call had as a ``Tensor[]``
(Note [Training programs in AOTInductor packages] in csrc/aoti_backward.cpp).
The package then runs in any process that has the ops registered: from C++
with ``torch::inductor::AOTIModelPackageLoader`` and the ops library linked,
or from Python with ``torch._inductor.aoti_load_package``.

Example::

    >>> import torch, torch_opaque, torch_opaque.aoti
    >>> @torch_opaque.op(name="DocAotiSin")
    ... class DocSin(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.sin()
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return g * x.cos()
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(4, 3)
    ...     def forward(self, x):
    ...         return DocSin.apply(self.lin(x))
    >>> step = torch_opaque.export_training(Net(), (torch.randn(5, 4),),
    ...                                     loss=lambda y: y.pow(2).mean())
    >>> ready = torch_opaque.aoti.for_aoti(step)
    >>> sorted({str(n.target) for n in ready.graph.nodes if "Doc" in str(n.args)})
    ['torch_opaque.call_bwd.default']
"""

from __future__ import annotations

import copy
import operator
from typing import Optional

import torch

from .ops import opaque_nodes

__all__ = ["for_aoti", "compile_and_package"]


def _call_bwd():
    # Registered by libtorch_opaque (csrc/aoti_backward.cpp), which importing
    # torch_opaque loads.
    return torch.ops.torch_opaque.call_bwd.default


def for_aoti(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``ep`` that ``torch._inductor.aoti_compile_and_package`` can
    package: each ``Name_bwd`` call becomes ``torch_opaque::call_bwd`` with the
    same arguments, returning only the gradients the call had when traced (its
    ``None`` ones are not in the program). A program without ``Name_bwd`` calls
    is returned as a copy, unchanged. ``ep.module()`` of the copy computes what
    ``ep.module()`` does."""
    out = copy.deepcopy(ep)
    graph = out.graph_module.graph
    call_bwd = _call_bwd()
    changed = False
    for node, info in opaque_nodes(out.graph_module):
        if info.role != "bwd":
            continue
        values = node.meta.get("val")
        if not isinstance(values, (list, tuple)):
            raise RuntimeError(
                f"torch_opaque.aoti.for_aoti: the {info.qualified_name}_bwd call {node.name} has "
                "no traced value (node.meta['val']); export the program with torch.export or "
                "torch_opaque.export_training."
            )
        present = [v is not None for v in values]
        position = {old: new for new, old in enumerate(i for i, p in enumerate(present) if p)}
        schema = node.target._schema
        args = list(node.args) + [
            node.kwargs[a.name] if a.name in node.kwargs else a.default_value
            for a in schema.arguments[len(node.args):]
        ]
        target = f"{schema.name}.{node.target._overloadname}"
        for user in node.users:
            if user.target is not operator.getitem or user.args[1] not in position:
                raise RuntimeError(
                    f"torch_opaque.aoti.for_aoti: {user.name} uses the {info.qualified_name}_bwd "
                    f"call {node.name} other than by taking one of its gradients; this program "
                    "cannot be rewritten for AOTInductor."
                )
        with graph.inserting_after(node):
            new = graph.call_function(call_bwd, (target, present, *args))
        new.meta = dict(node.meta)
        new.meta["val"] = [v for v in values if v is not None]
        for user in list(node.users):
            user.args = (new, position[user.args[1]])
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        out.graph_module.recompile()
    return out


def compile_and_package(
    ep: torch.export.ExportedProgram,
    package_path: Optional[str] = None,
    inductor_configs: Optional[dict] = None,
    **kwargs,
) -> str:
    """``torch._inductor.aoti_compile_and_package(for_aoti(ep), ...)``: the path
    of the ``.pt2`` package.

    Every parameter and buffer stays a constant of the package, which a trainer
    updates between steps (``AOTIModelPackageLoader::load_constants`` in C++,
    ``load_constants`` of ``torch._inductor.aoti_load_package``'s model in
    Python): by default Inductor bakes the values of small ones (a 0-d tensor,
    a 1-d tensor of up to 8 elements, such as a bias) into the compiled code,
    and updating them would change nothing. ``inductor_configs`` entries are
    passed on, ``always_keep_tensor_constants=True`` unless it says otherwise."""
    configs = {"always_keep_tensor_constants": True, **(inductor_configs or {})}
    return torch._inductor.aoti_compile_and_package(
        for_aoti(ep), package_path=package_path, inductor_configs=configs, **kwargs
    )
