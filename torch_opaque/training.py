"""Exporting a training step: the loss and its gradients, with each Function's
custom backward kept as an opaque ``Name_bwd`` node.

``torch.export`` keeps a wrapped Function as one ``Name`` node, but its joint
(forward + backward) program is what a trainer outside Python needs. Built on
``torch.export.experimental._export_forward_backward``: the exported program is
differentiated by AOTAutograd, where each opaque call becomes ``Name_fwd``
(forward and saved tensors) and ``Name_bwd`` (the user's backward, opaque).

Example::

    >>> import torch, torch_opaque
    >>> @torch_opaque.op(name="DocTrainSin")
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
    >>> net = Net()
    >>> batch = torch.export.Dim("batch")
    >>> step = torch_opaque.export_training(
    ...     net, (torch.randn(5, 4),), loss=lambda y: y.pow(2).mean(),
    ...     dynamic_shapes=({0: batch},))
    >>> torch_opaque.training_outputs(step)
    ['loss', 'lin.weight', 'lin.bias']
    >>> loss, grad_w, grad_b = step.module()(torch.randn(8, 4))   # any batch size
    >>> sorted({str(n.target) for n in step.graph.nodes if "DocTrainSin" in str(n.target)})
    ['opaque.DocTrainSin_bwd.Tensor', 'opaque.DocTrainSin_fwd.Tensor']
"""

from __future__ import annotations

import inspect
import re
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind

from .errors import UnsupportedError

__all__ = ["export_training", "training_outputs"]


class _WithLoss(torch.nn.Module):
    """``loss(model(*args, **kwargs))`` as one module. The model's parameters and
    buffers keep their names (registered without a prefix), and ``forward`` shows
    the model's signature, so ``dynamic_shapes`` are given as for the model."""

    def __init__(self, model: torch.nn.Module, loss: Callable):
        super().__init__()
        # The same dicts, not copies: export swaps parameters for traced values
        # through this module, and the model's forward must see the swap.
        for d in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            object.__setattr__(self, d, getattr(model, d))
        # (not registered as submodules: that would add them to the model's dicts)
        object.__setattr__(self, "_model_forward", model.forward)
        object.__setattr__(self, "_loss", loss)

        def forward(*args, **kwargs):
            return self._loss(self._model_forward(*args, **kwargs))

        forward.__signature__ = inspect.signature(model.forward)
        self.forward = forward


def export_training(
    model: torch.nn.Module,
    args: tuple,
    kwargs: Optional[dict] = None,
    *,
    loss: Optional[Callable] = None,
    dynamic_shapes=None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """Export one training step of ``model``: an ExportedProgram whose
    ``module()`` takes the model's inputs and returns a tuple
    ``(loss, *gradients)``.

    * ``loss=None``: the model returns a scalar loss; otherwise ``loss(outputs)``
      is the scalar loss (e.g. ``lambda y: y.pow(2).mean()``).
    * Gradient order (also given by :func:`training_outputs`): the model's
      parameters that require grad, in ``named_parameters()`` order, then the
      inputs that require grad, in argument order.
    * Each call of a wrapped Function (``op``/``wrap``, or inside ``auto()``)
      appears as ``Name_fwd`` + ``Name_bwd`` nodes: the custom backward travels
      with the program. The rest of the program is core ATen.
    * ``dynamic_shapes`` and ``strict`` are as for ``torch.export.export``.
    """
    from torch.export.experimental import _export_forward_backward

    module = model if loss is None else _WithLoss(model, loss)
    ep = torch.export.export(
        module, tuple(args), kwargs or {}, dynamic_shapes=dynamic_shapes, strict=strict
    )
    loss_out = [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    val = ep.graph.output_node().args[0][0].meta.get("val") if loss_out else None
    if len(loss_out) != 1 or not isinstance(val, torch.Tensor) or val.dim() != 0:
        raise UnsupportedError(
            "torch_opaque.export_training: the exported step must return one scalar loss, but "
            f"{'the model' if loss is None else 'loss(outputs)'} returned "
            f"{len(loss_out)} output(s)"
            + (f" of shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else "")
            + ". Return a scalar (e.g. `.mean()`), or pass loss=<outputs -> scalar>."
        )
    joint = _export_forward_backward(ep)
    # The joint program's outputs (loss, gradients) are a flat tuple: say so in
    # the module call signature, so that ep.module() returns them.
    n_out = len(joint.graph_signature.output_specs)
    joint.module_call_graph[0].signature.out_spec = pytree.tree_structure(tuple(range(n_out)))
    return joint


def training_outputs(ep: torch.export.ExportedProgram) -> list:
    """What ``ep.module()`` of a program from :func:`export_training` returns, in
    order: ``"loss"``, then the name of each parameter (``"lin.weight"``) or user
    input (``"input:x"``) whose gradient follows. Read from the program's graph
    signature, so it also works on a loaded program."""
    inputs = ep.graph_signature.input_specs
    user = [s.arg.name for s in inputs if s.kind.name == "USER_INPUT"]
    names = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.LOSS_OUTPUT:
            names.append("loss")
        elif spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            names.append(spec.target)
        elif spec.kind == OutputKind.GRADIENT_TO_USER_INPUT:
            names.append(f"input:{_user_input_name(spec.target, inputs, user)}")
        else:
            names.append(spec.arg.name)
    return names


def _user_input_name(target: str, inputs, user: list) -> str:
    """AOTAutograd names the differentiated input by its flat position
    (``arg<k>_1``: parameters and buffers first, then user inputs)."""
    if target in user:
        return target
    m = re.fullmatch(r"arg(\d+)_1", target)
    if m and 0 <= int(m.group(1)) < len(inputs):
        return inputs[int(m.group(1))].arg.name
    return target
