"""Weights and constants checked against the placeholders that receive them.

Note [Weights match their placeholders]
A weight or constant is read from its own payload record (dtype, sizes,
strides, layout, device), the graph from its own JSON: nothing made them
agree, and a kernel compiled for the placeholder's float32 [2, 3] runs on
whatever the payload holds (uint64 garbage, fewer bytes). Every parameter,
buffer and tensor constant must have its placeholder's dtype, shape (a
symbolic size of a weight is refused: torch.export never writes one),
layout and device, as the placeholder's recorded value (``meta['val']``)
says; strides may differ (torch.export saves the storage as it was).
"""

from __future__ import annotations

import torch


def weights_mismatch(ep, where: str):
    """Why a weight or constant of `ep` does not match its placeholder, or None."""
    from torch.export.graph_signature import InputKind

    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        name = getattr(spec.arg, "name", None)
        node = placeholders.get(name)
        want = node.meta.get("val") if node is not None else None
        got = ep.constants.get(spec.target) if spec.target in ep.constants else ep.state_dict.get(spec.target)
        kind = spec.kind.name.lower().replace("_tensor", "")
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            if spec.kind == InputKind.BUFFER and got is None and not spec.persistent:
                continue  # a non-persistent buffer torch did not save: torch.export refuses to run it
            return (
                f"the {kind} '{spec.target}' of placeholder '{name}' in {where} is "
                f"{type(got).__name__}, its placeholder records {type(want).__name__}; every "
                f"weight must be a tensor its placeholder describes"
            )
        shape = tuple(want.shape)
        if not all(isinstance(n, int) for n in shape):
            return (
                f"the placeholder '{name}' of the {kind} '{spec.target}' in {where} has the "
                f"symbolic size {list(shape)}; a weight's size is fixed"
            )
        have = (got.dtype, tuple(got.shape), got.layout, got.device)
        need = (want.dtype, shape, want.layout, want.device)
        if have != need:
            fields = ", ".join(
                f"{f} {h} (the placeholder says {n})" for f, h, n in zip(("dtype", "shape", "layout", "device"), have, need) if h != n
            )  # fmt: skip
            return (
                f"the {kind} '{spec.target}' in {where} does not match its placeholder "
                f"'{name}': {fields}; a kernel would read it as the placeholder's type"
            )
    return None
