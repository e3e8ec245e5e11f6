"""Which operators a program loaded from a file may call.

Note [Operators a loaded program may call]
A loaded graph runs every operator it names, with arguments from the file, so
naming an operator is running code, and a kernel that trusts its arguments
(an index it does not check, a tensor whose invariants it assumes) reads or
writes memory outside its tensors. Allowed (for call targets and for
operators passed as arguments, ``as_operator``, alike):

* ATen, prims and rngprims operators only when a family of Note [Admitted
  operator families] (admitted_ops.py) admits them: an allow list, each
  family with the one-line reason its kernels check their arguments, and no
  ``out=`` overloads. Anything else is refused at load, naming the operator
  and the ways on: call it inside a Function of an allowed module, or have it
  admitted. Some operators are refused with a reason of their own
  (``_REFUSED``), so that the error says why they can never be admitted:
  - ``storage``: those that read or write files, re-point, resize or share
    storage, or print (``from_file``, ``set_``, ``resize_``, ``_print``,
    ``record_stream``, ...);
  - ``unchecked``: kernels that index with values from their arguments without
    checking them (``ctc_loss``, whose targets past the classes read outside
    the log-probabilities; the max-pool backwards that scatter through given
    ``indices``; ``embedding_dense_backward``; ``segment_reduce``, whose
    ``unsafe=True`` skips its length check);
  - ``sparse``: sparse tensors built or edited from raw parts, whose
    invariants (indices within the size) the sparse kernels assume: the
    unchecked constructors (``_sparse_coo_tensor_unsafe``, ... and the public
    ``sparse_coo_tensor`` family, which checks only when asked), the aliases of
    a sparse tensor's parts (``_indices``, ``_values``, ``indices``,
    ``crow_indices``, ...: writing through them breaks the invariants), and
    ``_coalesced_`` (which marks a tensor coalesced without looking);
  - ``state``: operators that change the caller's process state: autograd
    state of a tensor (``requires_grad_``, ``retain_grad``, ``detach_``,
    ``set_data``, ``_backward``, forward-AD duals, functorch batch levels);
    grad mode, the RNG seed and the other TorchScript builtins in the aten
    namespace (``aten::set_grad_enabled``, ``aten::manual_seed``, ``warn``,
    ...) are not dispatcher operators at all. Grad mode and autocast change
    only inside the higher-order operators that scope them
    (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``);
* the batch-norm family (``native_batch_norm``, ``_native_batch_norm_legit*``,
  ...) only with arguments the loader checked (:func:`check_batch_norm`): its
  CPU kernels index the weight, bias and running statistics by the input's
  channel without checking their sizes;
* none of torch's other namespaces that compute on packed or unchecked
  layouts (``quantized``, ``mkldnn``, ``onednn``, ``mkl``, ``sparse``,
  ...: their kernels trust prepacked weights and layouts they do not check),
  nor those with effects outside the computation (``profiler``,
  ``debugprims``, the collectives, ``inductor``'s storage ops:
  ``_REFUSED_NAMESPACES``);
* the higher-order operators that only structure a computation (``cond``,
  ``while_loop``, ``wrap_with_set_grad_enabled``, ... ``_HIGHER_ORDER``), not
  those that print, call Python or compiled code (``print``, ``call_torchbind``,
  ``inline_asm_elementwise``, ``invoke_leaf_function``, ...);
* the symbolic-size arithmetic torch serializes (``_operator.add``, ``torch.sym_max``);
* other operators (opaque ops, the user's own libraries) only when the loader
  says so (``custom_ok``): opaque ops the manifest describes, ops this process
  has registered itself.

A new PyTorch release's new operator is refused until a family admits it
(and the fuzz test covers it).

What a graph may write is Note [Writes a loaded program may make] (writes.py).

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

from . import admitted_ops

_OP_TARGET_RE = re.compile(r"^torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z_][A-Za-z0-9_]*)?$")

_REFUSED = {
    "storage": (
        "it reads or writes files or storage outside the computation",
        {
            "from_file", "set", "set_", "set_data", "resize", "resize_", "resize_as", "resize_as_",
            "resize_as_sparse", "resize_as_sparse_", "_resize_output", "_resize_output_", "sparse_resize",
            "sparse_resize_", "sparse_resize_and_clear", "sparse_resize_and_clear_", "_copy_from_and_resize",
            "record_stream", "_reshape_alias", "_reshape_alias_copy", "_print", "_cufft_set_plan_cache_max_size",
            "_cufft_clear_plan_cache", "_nested_view_from_buffer", "_nested_view_from_buffer_copy",
            "_nested_view_from_jagged", "_nested_view_from_jagged_copy", "pin_memory", "_pin_memory",
        },
    ),
    "unchecked": (
        "its kernel indexes memory with values from its arguments without checking them",
        {
            "ctc_loss", "_ctc_loss", "_ctc_loss_backward", "_cudnn_ctc_loss", "max_pool2d_with_indices_backward",
            "max_pool3d_with_indices_backward", "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward",
            "fractional_max_pool2d_backward", "fractional_max_pool3d_backward", "embedding_dense_backward",
            "embedding_backward", "embedding_sparse_backward", "segment_reduce", "_segment_reduce_backward",
            "_index_put_impl", "_index_put_impl_",
            # found by tests/archive/test_archive_op_fuzz.py (SIGSEGV or SIGABRT on hostile arguments)
            "_cummax_helper", "_cummin_helper", "_weight_norm_interface_backward", "_stack", "_foreach_copy",
            "_foreach_copy_", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "_fft_r2c",
            "_fft_c2r", "_fft_c2c", "reflection_pad1d_backward", "reflection_pad2d_backward",
            "reflection_pad3d_backward", "_cdist_backward", "_pdist_backward", "_weight_norm",
            "_weight_norm_interface",
        },
    ),
    "sparse": (
        "it builds or edits a sparse tensor from raw parts without checking its invariants",
        {
            "_sparse_coo_tensor_unsafe", "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe",
            "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe", "_sparse_compressed_tensor_unsafe",
            "_sparse_coo_tensor_with_dims_and_tensors", "_sparse_coo_tensor_with_dims",
            "_sparse_compressed_tensor_with_dims", "sparse_coo_tensor", "sparse_compressed_tensor",
            "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
            "_indices", "_values", "indices", "values", "crow_indices", "col_indices", "ccol_indices",
            "row_indices", "_indices_copy", "_values_copy", "indices_copy", "values_copy",
            "crow_indices_copy", "col_indices_copy", "ccol_indices_copy", "row_indices_copy",
            "_coalesced", "_coalesced_",
        },
    ),
    "state": (
        "it changes the caller's autograd or process state",
        {
            "requires_grad_", "retain_grad", "detach_", "_backward", "_make_dual", "_make_dual_copy",
            "_unpack_dual", "_fw_primal", "_fw_primal_copy", "_add_batch_dim", "_remove_batch_dim",
            "_propagate_xla_data", "_cudnn_init_dropout_state", "_amp_update_scale", "_amp_update_scale_",
        },
    ),
}  # fmt: skip
_WHY_REFUSED = {name: why for why, names in _REFUSED.values() for name in names}
_COMPUTING_NAMESPACES = {"aten", "prims", "rngprims"}
_REFUSED_NAMESPACES = {
    "profiler", "debugprims", "c10d", "_c10d_functional", "_c10d_functional_autograd",
    "c10d_functional", "symm_mem", "_dtensor", "inductor", "inductor_prims", "static_runtime", "_test",
    "debug_mode_ops", "_native", "fsdp", "streams",
}  # fmt: skip
_PACKED_NAMESPACES = {
    "quantized", "_quantized", "quantization", "mkldnn", "mkldnn_prepacked", "onednn", "mkl", "sparse",
}  # fmt: skip
_HIGHER_ORDER = {
    "associative_scan", "auto_functionalized", "auto_functionalized_v2", "cond", "flex_attention",
    "flex_attention_backward", "hints_wrapper", "invoke_subgraph", "map_impl", "out_dtype",
    "scan", "tag_activation_checkpoint", "while_loop", "while_loop_stack_output", "with_effects",
    "wrap", "wrap_activation_checkpoint", "wrap_with_autocast", "wrap_with_set_grad_enabled",
    "run_const_graph", "_export_tracepoint",
}  # fmt: skip


NOT_ADMITTED = (
    "it is not one of the operators a loaded program may call, those whose kernels check their "
    "arguments (the families of docs/shipping.md#admitted-operators); call it inside a Function "
    "of a module you allow (load(..., allow=[...])), or file an issue naming the operator to have "
    "it admitted"
)


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
        return _computing_op(t, ns, name, m.group(3)[1:])
    if ns in _PACKED_NAMESPACES:
        return _refused(t, f"the {ns} namespace's kernels trust packed weights and layouts they do not check")
    if ns in _REFUSED_NAMESPACES:
        return _refused(t, f"the {ns} namespace acts outside the computation")
    if not custom_ok(t):
        return _refused(
            t,
            f"the archive does not describe it and this process has not registered it; import "
            f"the library that defines {ns}::{name} before loading",
        )
    return None


def _computing_op(t: str, ns: str, name: str, overload: str) -> Optional[str]:
    if name in _WHY_REFUSED:
        return _refused(t, _WHY_REFUSED[name])
    schema = _dispatcher_schema(ns, name, overload)
    if schema is None:
        return _refused(
            t,
            "not a dispatcher operator of torch (a TorchScript builtin such as "
            "aten::set_grad_enabled or aten::manual_seed changes process state, or the "
            "operator does not exist)",
        )
    if admitted_ops.family_of(ns, name) is None:
        return _refused(t, NOT_ADMITTED)
    if any(a.is_out for a in schema.arguments):
        return _refused(
            t,
            "an out= overload, which resizes the tensor it is given; torch.export writes the "
            "functional overload (export the program again and save it with torch_opaque.save)",
        )
    return None


# The batch-norm family: (position of the input, positions of the per-channel
# tensors: weight, bias, running and saved statistics) for each.
_BATCH_NORM = {
    **dict.fromkeys(
        ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
         "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
         "_batch_norm_with_update_functional", "_batch_norm_no_update", "batch_norm",
         "batch_norm_update_stats", "batch_norm_elemt", "cudnn_batch_norm", "miopen_batch_norm"),
        (0, (1, 2, 3, 4)),
    ),
    **dict.fromkeys(("native_batch_norm_backward", "batch_norm_backward"), (1, (2, 3, 4, 5, 6))),
}  # fmt: skip


def check_batch_norm(gm, where: str) -> Optional[str]:
    """Why a call of the batch-norm family in `gm` (or a graph nested in it)
    has a per-channel argument that is not one value per channel of its input,
    or None (Note [Operators a loaded program may call]). The sizes are those
    the graph records for each value (``meta['val']``); the loader checks them
    against the weights and the inputs' guards check the caller's tensors."""
    import torch

    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            spec = _BATCH_NORM.get(node.target._schema.name.split("::")[-1])
            if spec is None:
                continue
            why = _batch_norm_args(node, *spec)
            if why is not None:
                return f"node '{node.name}' ({node.target}) in {where}: {why}"
    return None


def _batch_norm_args(node, at: int, per_channel: tuple) -> Optional[str]:
    import torch

    args = list(node.args) + [node.kwargs.get(a.name) for a in node.target._schema.arguments[len(node.args) :]]
    x = args[at].meta.get("val") if isinstance(args[at], torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return "its input has no recorded size with a channel dimension"
    channels = x.shape[1]
    for i in per_channel:
        a = args[i] if i < len(args) else None
        if a is None:
            continue
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or not _same(v.shape[0], channels):
            shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return (
                f"its argument '{node.target._schema.arguments[i].name}' has the size {shape}, not one "
                f"value per channel of the input ({channels}); its kernel would index past it"
            )
    return None


def _same(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


@functools.lru_cache(maxsize=4096)
def _dispatcher_schema(ns: str, name: str, overload: str):
    """The schema of a dispatcher operator, or None (TorchScript builtins and
    names that are no operator)."""
    import torch

    if ns == "prims":
        import torch._prims  # noqa: F401  (registers the prims operators)
    try:
        torch._C._dispatch_find_schema_or_throw(f"{ns}::{name}", "" if overload == "default" else overload)
        return getattr(getattr(getattr(torch.ops, ns), name), overload)._schema
    except (RuntimeError, AttributeError):
        return None


# ---- stored programs ---------------------------------------------------------------------------

from .writes import check_stored_graph  # noqa: E402,F401  (Note [Writes a loaded program may make])
