"""ONNX export of training programs: ``Name_fwd`` and ``Name_bwd`` nodes.

Note [ONNX export of training programs]
A program from ``torch_opaque.export_training`` calls each Function as
``Name_fwd(args, needs_input_grad) -> (outs..., Tensor[] residuals)`` and
``Name_bwd(Tensor?[] saved, Tensor?[] grads, bool[] needs_input_grad, str state,
SymInt[] state_ints) -> Tensor?[]``. Each call becomes one node of the custom
domain, ``op_type`` ``Name_fwd`` / ``Name_bwd``, as the inference op does
(Note [ONNX export of opaque ops] in torch_opaque/onnx/__init__.py), with these differences:

* outputs are flat: ``Name_fwd`` has the outputs, then one output per residual;
  ``Name_bwd`` one output per gradient the call produces (its ``None``
  gradients have none). torch.onnx wants a flat list of values from a
  translation, but the FX graph indexes the residuals as a nested list
  (``getitem(getitem(fwd, n_out), j)``): the translation returns the outputs
  followed by a list of the residual values, a list that torch.onnx can name
  (:class:`ValueList`), so both ``getitem``s find their value;
* how many residuals a call has, and which gradients are None, is read from
  the FX graph before export (``meta["val"]``), per call kind (target and
  non-tensor arguments): a translation only sees the call's arguments;
* ``Tensor?[]`` inputs spread over inputs ``saved_0, saved_1, ...``, an empty
  input for ``None``; ``needs_input_grad`` is an int list attribute, ``state``
  a string attribute (so the backward's ctx state is baked into its node and
  function);
* the function bodies: ``Name_fwd`` is the user's forward run by the same C++
  path as the real kernel (outputs and residuals: ``_impl.tracing.ForwardTrace``,
  which takes needs_input_grad from the call), ``Name_bwd`` the user's
  backward run with the call's state (``_impl.tracing.BackwardTrace``); both
  traced to ATen and exported as the inference bodies are (onnx/functions.py).
  An op defined in C++ runs its own ``_fwd`` / ``_bwd`` kernels instead
  (``_impl.cpp_kernels``).
"""

from __future__ import annotations

import torch



class TrainingCalls:
    """Per call kind of ``Name_fwd`` / ``Name_bwd`` in a program: the number of
    residuals, or the positions of the gradients that are not None."""

    def __init__(self):
        self.kinds: dict = {}

    @staticmethod
    def key(target, constants) -> str:
        return repr((target.name(), constants))

    def add(self, target, constants, fx_node: torch.fx.Node, role: str) -> None:
        val = fx_node.meta.get("val")
        if role == "fwd":
            shape = len(val[-1])
        else:
            shape = tuple(i for i, g in enumerate(val) if g is not None)
        k = self.key(target, constants)
        if self.kinds.setdefault(k, shape) != shape:
            raise ValueError(
                f"calls of {target.name()} with the same non-tensor arguments differ in "
                f"{'their residual count' if role == 'fwd' else 'which gradients are None'}"
            )

    def get(self, target, constants):
        return self.kinds[self.key(target, constants)]


class ValueList(list):
    """A list of ONNX values that torch.onnx can give a name, as it does to the
    value of every FX node (the residual list of a ``Name_fwd`` call)."""

    name = None

    def producer(self):
        return None


def with_user_outputs(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A training program whose outputs (loss, gradients) are marked as user
    outputs, which is what torch.onnx exports as graph outputs (it drops the
    others); the same program otherwise. Other programs are returned as they are."""
    from torch.export.graph_signature import ExportGraphSignature, OutputKind, OutputSpec

    sig = ep.graph_signature
    training = (OutputKind.LOSS_OUTPUT, OutputKind.GRADIENT_TO_PARAMETER,
                OutputKind.GRADIENT_TO_USER_INPUT)  # fmt: skip
    if not any(s.kind in training for s in sig.output_specs):
        return ep
    outputs = [
        OutputSpec(OutputKind.USER_OUTPUT, s.arg, None) if s.kind in training else s
        for s in sig.output_specs
    ]
    return torch.export.ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=ExportGraphSignature(list(sig.input_specs), outputs),
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        example_inputs=ep.example_inputs,
        constants=ep.constants,
    )
