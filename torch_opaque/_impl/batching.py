"""Batching rules (vmap) of a wrapped Function's ops.

Note [Batching rules]
Each overload registers a FuncTorchBatched kernel for ``Name``, ``Name_fwd``,
``Name_bwd`` (and ``Name_jvp`` when defined), so ``torch.vmap``,
``torch.func.jacrev``/``jacfwd``, ``vmap(grad(f))``,
``autograd.grad(..., is_grads_batched=True)`` and
``autograd.functional.jacobian(vectorize=True)`` work:

* the Function's ``vmap`` staticmethod, when it has one, batches ``Name``
  (through torch's own helper for vmap staticmethods) and, for a Function with
  ``setup_context``, ``Name_fwd`` (its ctx is then set up from the batched
  inputs and outputs, as stock autograd.Function does under torch.func);
* ``generate_vmap_rule = True``: the user's forward (``Name``, ``Name_fwd``),
  backward (``Name_bwd``) and jvp (``Name_jvp``) run once, on the batched
  tensors of a fresh vmap level, as stock's generated rule runs them
  (torch/_functorch/autograd_function.py, vmapify_autograd_function). Why
  not on the kernel's own level: to call the op's batching kernel, functorch's
  front fallback saves the thread's dispatch key state on the level and
  replaces it with the level's processing state (its entry key excluded).
  Code run there bypasses functorch's entry (view operations on the batched
  tensors then fail: "Attempted to make a tensor into a differentiable view",
  and a stock Function's custom_function_call finds no rule), and with user
  code's key state it would re-enter the level being processed, which
  functorch forbids (one saved state per level: its INTERNAL ASSERT
  "!savedLocalDispatchKeySet_.has_value()"). So the kernel steps
  down (``interpreter.lower()``), restores user code's key state (the
  one functorch saved on the level: ``_as_user_code``) and opens a fresh
  vmap level of the same size and randomness (torch's ``restore_vmap``); the
  saved tensors keep their batch dimensions (rewrapped at the kernel's level). The backward of a
  Function with a ``vmap`` staticmethod runs the same way (stock runs it on
  the batched tensors too). In-place Functions (``ctx.mark_dirty``) stay per
  sample (stock's generated rule refuses them);
* everything else runs once per sample and is stacked: ``Name_jvp`` of
  Functions with a ``vmap`` staticmethod, and everything of Functions with
  neither ``vmap`` nor ``generate_vmap_rule`` (stock refuses those under
  vmap). Forwards and jvps run below the batching key; a backward runs as
  user code of the level below (so a stock Function it calls, or its
  operations under an enclosing grad level, see that level as in the user's
  code). A forward run per sample must leave the same non-tensor ctx state
  for every sample (it becomes one backward).

``is_grads_batched`` and ``jacobian(vectorize=True)`` use torch's older vmap
(the ``Batched`` key): there ``Name_bwd`` (and ``Name_jvp``) run the user's
code on the batched tensors, as stock autograd.Function does.
"""

from __future__ import annotations

import json

import torch
import torch.utils._pytree as pytree
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch._functorch.autograd_function import custom_function_call_vmap_helper
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch._functorch.vmap import restore_vmap, wrap_batched

from .._native import _C
from ..errors import UnsupportedError


def _unwrap(args, level):
    flat, spec = pytree.tree_flatten(list(args))
    pairs = [_unwrap_batched(a, level) if isinstance(a, torch.Tensor) else (a, None) for a in flat]
    return [p[0] for p in pairs], [p[1] for p in pairs], spec


def _sample(flat, dims, spec, b):
    leaves = [a if d is None else a.select(d, b) for a, d in zip(flat, dims)]
    return pytree.tree_unflatten(leaves, spec)


def _batched(out, level):
    return pytree.tree_map(
        lambda t: _add_batch_dim(t, 0, level) if isinstance(t, torch.Tensor) else t, out
    )


def _stack(results, level):
    """Per-sample results (same structure, tensors or None) -> batched at `level`."""
    flats = [pytree.tree_flatten(r) for r in results]
    stacked = [
        torch.stack(leaves) if isinstance(leaves[0], torch.Tensor) else leaves[0]
        for leaves in zip(*(f[0] for f in flats))
    ]
    return _batched(pytree.tree_unflatten(stacked, flats[0][1]), level)


def per_sample(call, args, as_user_code=False):
    """``call(*args)`` for each sample of the current vmap level, stacked; the
    calls run below the batching key (their tensors are unwrapped), or, with
    `as_user_code`, as user code of the level below (Note [Batching rules])."""
    interp = retrieve_current_functorch_interpreter()
    level = interp.level()
    flat, dims, spec = _unwrap(args, level)
    if all(d is None for d in dims):
        with _below():
            return call(*pytree.tree_unflatten(flat, spec))

    def each():
        return [call(*_sample(flat, dims, spec, b)) for b in range(interp.batch_size())]

    if as_user_code:
        results = _as_user_code(interp, each)
    else:
        with _below():
            results = each()
    return _stack(results, level)


def generated(call, args):
    """``call(*args)`` run once on the batched tensors of a fresh vmap level, as
    user code (Note [Batching rules]); its results batched at the current level
    (tensors without a batch dimension there are returned as they are)."""
    interp = retrieve_current_functorch_interpreter()
    level = interp.level()
    flat, dims, spec = _unwrap(args, level)
    if all(d is None for d in dims):
        with _below():
            return call(*pytree.tree_unflatten(flat, spec))

    batched = restore_vmap(
        lambda *leaves: call(*pytree.tree_unflatten(list(leaves), spec)),
        tuple(dims), interp.batch_size(), interp.randomness(),
    )
    out, out_dims = _as_user_code(interp, lambda: batched(*flat))
    return wrap_batched(out, out_dims, level)


def _as_user_code(interp, fn):
    """``fn()`` one level down (`interp` lowered), with the thread-local
    dispatch key state functorch saved on the level being processed when it
    entered it: the state of the level's user code (Note [Batching rules]).
    Read from the level's interpreter, whose serialized form is the only
    public view of it; forced before lowering, which may change it."""

    def lowered():
        with interp.lower():
            return fn()

    saved = json.loads(torch._C._functorch.peek_interpreter_stack().serialize())
    keys = saved.get("savedLocalDispatchKeySet")
    if not keys:
        return lowered()
    return _C.call_with_dispatch_keys(lowered, keys["included"], keys["excluded"])


def _below():
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
    )


class Rules:
    """The FuncTorchBatched kernels of one Overload (Note [Batching rules])."""

    def __init__(self, overload, cls):
        self.ov = overload
        # No reference to the class (Note [Registry lifetime] in registry.py).
        self.user_vmap = cls.vmap is not torch.autograd.Function.vmap
        # Stock refuses a Function with both (custom_function_call_vmap); in-place
        # Functions (mark_dirty, refused by stock's generated rule) stay per sample.
        self.generated = (
            bool(getattr(cls, "generate_vmap_rule", False))
            and not self.user_vmap
            and not overload.dirty
        )
        self.setup_style = overload.fn.setup_style

    def register(self, lib, base: str):
        suffix = f".{self.ov.overload}" if self.ov.overload else ""
        lib.impl(f"{base}{suffix}", self.op, "FuncTorchBatched")
        lib.impl(f"{base}_fwd{suffix}", self.fwd, "FuncTorchBatched")
        lib.impl(f"{base}_bwd{suffix}", self.bwd, "FuncTorchBatched")
        lib.impl(f"{base}_bwd{suffix}", self.bwd_legacy, "Batched")
        if self.ov.jvp_op is not None:
            lib.impl(f"{base}_jvp{suffix}", self.jvp, "FuncTorchBatched")
            lib.impl(f"{base}_jvp{suffix}", self.ov.jvp_kernel, "Batched")

    # ---- Name (no graph) ------------------------------------------------------

    def _single(self, outs):
        return outs[0] if len(outs) == 1 else tuple(outs)

    def op(self, *args, **kwargs):
        ov = self.ov
        args = ov.runner.complete(args, kwargs) if kwargs or len(args) != ov.runner.n_args else args
        if self.user_vmap:
            interp = retrieve_current_functorch_interpreter()
            if all(d is None for d in _unwrap(args, interp.level())[1]):
                with _below():
                    return ov.op(*args)

            def rule(info, in_dims, *a):
                return ov.fn.cls.vmap(info, in_dims, *ov.runner.convert_args(a))

            # The stock helper of vmap staticmethods (the Function's class selects
            # its autograd.Function case: the user's code runs one level down).
            out = custom_function_call_vmap_helper(interp, rule, ov.fn.cls, *args)
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        if self.generated:
            return self._single(generated(lambda *a: ov.runner.run(None, a)[0], args))
        return per_sample(ov.op, args)

    # ---- Name_fwd (a training forward: outputs, residuals, record) --------------

    def fwd(self, *args, **kwargs):
        ov = self.ov
        needs = kwargs.pop("needs_input_grad", None)
        if len(args) > ov.runner.n_args:
            needs, args = args[-1], args[:-1]
        if kwargs or len(args) != ov.runner.n_args:
            args = ov.runner.complete(args, kwargs)
        runner = ov.runner
        interp = retrieve_current_functorch_interpreter()
        if all(d is None for d in _unwrap(args, interp.level())[1]):
            with _below():
                return ov.fwd_op(*args, needs)
        if self.user_vmap and self.setup_style:
            outs = self.op(*args)  # the vmap staticmethod
            outs, residuals, record = runner.run(needs, args, lambda *a: outs)
        elif self.generated:
            outs, residuals, record = generated(lambda *a: runner.run(needs, a), args)
        else:
            outs, residuals, record = self._fwd_per_sample(needs, args)
        if record is not None:
            _C.set_forward_record(*record)
        return (*outs, residuals)

    def _fwd_per_sample(self, needs, args):
        runner = self.ov.runner
        records = []

        def one(*a):
            outs, residuals, record = runner.run(needs, a)
            records.append(record)
            return list(outs), residuals

        outs, residuals = per_sample(one, args)
        first = records[0]
        for r in records[1:]:
            if r != first:
                raise UnsupportedError(
                    f"torch_opaque: {runner.fn_name} under vmap: its forward, run once per "
                    f"sample (it has no `vmap` staticmethod and no generate_vmap_rule), left "
                    f"different ctx state or saved tensors for different samples, which one "
                    f"backward cannot hold. Set generate_vmap_rule = True or add a `vmap` "
                    f"staticmethod to {runner.fn_name}."
                )
        return outs, residuals, first

    # ---- Name_bwd ---------------------------------------------------------------

    def bwd(self, saved, grads, needs, state, state_ints):
        ov = self.ov

        def backward(s, g):
            return list(ov.bwd_runner(s, g, needs, state, state_ints)[0])

        if self.generated or self.user_vmap:
            return generated(backward, (saved, grads))
        return per_sample(backward, (saved, grads), as_user_code=True)

    def bwd_legacy(self, saved, grads, needs, state, state_ints):
        return list(self.ov.bwd_runner(saved, grads, needs, state, state_ints)[0])

    # ---- Name_jvp (Note [Forward-mode AD] in forward_ad.py) ----------------------

    def jvp(self, *args):
        if self.generated:
            return generated(self.ov.jvp_kernel, args)
        return per_sample(self.ov.jvp_op, args)
