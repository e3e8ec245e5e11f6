"""Which operators a program loaded from a file may call.

Note [Operators a loaded program may call]
A loaded graph runs every operator it names, with arguments from the file, so
naming an operator is running code. Allowed (for call targets and for
operators passed as arguments, ``as_operator``, alike):

* ATen and prims operators that compute, except those that read or write
  files, re-point, resize or share storage, print, or build tensors whose
  invariants are not checked (``_DENIED``: ``aten::from_file``, ``set_``,
  ``resize_``, ``_sparse_coo_tensor_unsafe``, ...);
* torch's other computing namespaces (``quantized``, ``mkldnn``, ...), but not
  those with effects outside the computation (``profiler``, ``debugprims``,
  the collectives, ``inductor``'s storage ops: ``_REFUSED_NAMESPACES``);
* the higher-order operators that only structure a computation (``cond``,
  ``while_loop``, ``wrap_with_set_grad_enabled``, ... ``_HIGHER_ORDER``), not
  those that print, call Python or compiled code (``print``, ``call_torchbind``,
  ``inline_asm_elementwise``, ``invoke_leaf_function``, ...);
* the symbolic-size arithmetic torch serializes (``_operator.add``, ``torch.sym_max``);
* other operators (opaque ops, the user's own libraries) only when the loader
  says so (``custom_ok``): opaque ops the manifest describes, ops this process
  has registered itself.

A stored program (the forward or backward of a self-contained op) is also
checked after deserialization (:func:`check_stored_graph`): it may not write
to, resize or re-point its inputs, or anything that aliases them.

Example::

    >>> from torch_opaque.archive.op_policy import check_target
    >>> check_target("torch.ops.aten.sin.default", lambda t: False) is None
    True
    >>> check_target("torch.ops.aten.from_file.default", lambda t: False)
    "'torch.ops.aten.from_file.default' is not an operator a loaded program may call (it reads or writes files or storage outside the computation)"
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Optional

_OP_TARGET_RE = re.compile(r"^torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z_][A-Za-z0-9_]*)?$")

_DENIED = {
    # files, storage, re-pointing and resizing
    "from_file", "set", "set_", "set_data", "resize", "resize_", "resize_as", "resize_as_",
    "resize_as_sparse", "resize_as_sparse_", "_resize_output", "_resize_output_", "sparse_resize",
    "sparse_resize_", "sparse_resize_and_clear", "sparse_resize_and_clear_",
    "_copy_from_and_resize", "record_stream", "_reshape_alias", "_reshape_alias_copy",
    # global state and output
    "_print", "_cufft_set_plan_cache_max_size", "_cufft_clear_plan_cache",
    # tensors built from raw parts without checking their invariants
    "_sparse_coo_tensor_unsafe", "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe",
    "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe", "_sparse_compressed_tensor_unsafe",
    "_sparse_coo_tensor_with_dims_and_tensors", "_nested_view_from_buffer",
    "_nested_view_from_buffer_copy", "_nested_view_from_jagged", "_nested_view_from_jagged_copy",
}  # fmt: skip
_WHY_DENIED = "it reads or writes files or storage outside the computation"
_COMPUTING_NAMESPACES = {
    "aten", "prims", "quantized", "_quantized", "quantization", "onednn", "mkldnn",
    "mkldnn_prepacked", "mkl", "sparse", "rngprims", "inductor_prims",
}  # fmt: skip
_REFUSED_NAMESPACES = {
    "profiler", "debugprims", "c10d", "_c10d_functional", "_c10d_functional_autograd",
    "c10d_functional", "symm_mem", "_dtensor", "inductor", "static_runtime", "_test",
    "debug_mode_ops", "_native", "fsdp", "streams",
}  # fmt: skip
_HIGHER_ORDER = {
    "associative_scan", "auto_functionalized", "auto_functionalized_v2", "cond", "flex_attention",
    "flex_attention_backward", "hints_wrapper", "invoke_subgraph", "map_impl", "out_dtype",
    "scan", "tag_activation_checkpoint", "while_loop", "while_loop_stack_output", "with_effects",
    "wrap", "wrap_activation_checkpoint", "wrap_with_autocast", "wrap_with_set_grad_enabled",
    "run_const_graph", "_export_tracepoint",
}  # fmt: skip


def _refused(t: str, why: str) -> str:
    return f"{t!r:.120} is not an operator a loaded program may call ({why})"


@functools.lru_cache(maxsize=None)
def sym_targets() -> dict:
    """Serialized name -> function, for the symbolic-size operators torch writes."""
    import operator

    from torch._export.serde import serialize

    out = {f"{op.__module__}.{op.__name__}": op for op in serialize._SYM_OPS}
    out["_operator.getitem"] = operator.getitem
    return out


def check_target(t, custom_ok: Callable[[str], bool]) -> Optional[str]:
    """Why a serialized call target (or operator argument) may not be called by a
    loaded program (Note [Operators a loaded program may call]), or None."""
    if not isinstance(t, str):
        return "a call target is a string"
    if t in sym_targets():
        return None
    m = _OP_TARGET_RE.match(t)
    if m is None:
        return _refused(t, "only torch.ops.<namespace>.<op>.<overload> and symbolic-size arithmetic may be called")
    ns, name = m.group(1), m.group(2)
    if ns == "higher_order":
        if m.group(3) is not None or name not in _HIGHER_ORDER:
            return _refused(t, "a higher-order operator that prints, calls Python or runs compiled code")
        return None
    if m.group(3) is None:
        return _refused(t, "an operator call names its overload")
    if ns in _COMPUTING_NAMESPACES:
        if name in _DENIED:
            return _refused(t, _WHY_DENIED)
        return None
    if ns in _REFUSED_NAMESPACES:
        return _refused(t, f"the {ns} namespace acts outside the computation")
    if not custom_ok(t):
        return _refused(
            t,
            f"the archive does not describe it and this process has not registered it; import "
            f"the library that defines {ns}::{name} before loading",
        )
    return None


# ---- stored programs ---------------------------------------------------------------------------


def check_stored_graph(gm, where: str) -> Optional[str]:
    """Why a stored program's graph writes to, resizes or re-points one of its
    inputs (or a view of one), or None. Follows aliases through every op whose
    schema says an output aliases an argument."""
    import operator

    aliases = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            aliases.add(node)
            continue
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            if node.args and node.args[0] in aliases:
                aliases.add(node)
            continue
        schema = getattr(target, "_schema", None)
        if schema is None:  # higher-order operators: their subgraphs are functional in export
            continue
        bound = _bind(schema, node)
        for arg, value in bound:
            if arg.alias_info is not None and arg.alias_info.is_write and _touches(value, aliases):
                return (
                    f"node '{node.name}' ({target}) writes to its input '{arg.name}' in {where}: a "
                    f"stored program mutates its inputs, which the op's schema declares functional"
                )
        if any(r.alias_info is not None for r in schema.returns) and any(
            _touches(v, aliases) for a, v in bound if a.alias_info is not None
        ):
            aliases.add(node)
    return None


def _bind(schema, node) -> list:
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


def _touches(value, aliases: set) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_touches(v, aliases) for v in value)
    return value in aliases
