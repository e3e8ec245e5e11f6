"""The op family on DTensor inputs: one sharding rule for ``Name``, ``Name_fwd`` and ``Name_bwd``.

Note [Sharding opaque ops]
A stock Function's forward on DTensors is a chain of DTensor ops, each with
its own sharding strategy. The op hides that chain, so DTensor needs to be
told how the op shards; ``torch_opaque.register_sharding(Cls_or_op, rule)``
is that one call. ``rule`` is what
``torch.distributed.tensor.experimental.register_sharding`` takes for the
op's schema (called with the op's arguments, a ``DTensorSpec`` in place of
each tensor; it returns ``(output placements, input placements)`` pairs for
one mesh dimension, ``None`` for non-tensor arguments), or ``"pointwise"``:
every tensor argument and output shares one placement (all ``Replicate``,
or all ``Shard(d)`` when the tensor arguments have the same number of
dimensions), i.e. the Function runs as it is on the local shards.

The rule serves the whole family:
- ``Name`` (no autograd): registered as DTensor's strategy of the op, which
  DTensor then runs on local tensors like any op.
- ``Name_fwd``: a DTensor op handler asks DTensor's sharding propagator for
  ``Name``'s strategy (the cheapest acceptable one for the inputs' current
  placements), redistributes the inputs, runs ``Name_fwd`` on the local
  tensors, wraps its outputs with the chosen output specs and its residuals
  (local tensors whose global meaning only the backward knows) as
  ``Replicate`` DTensors, and appends one more residual: a one-element
  integer tensor naming the chosen specs (a tensor, so saved-tensor hooks and
  checkpointing carry it like the others).
- ``Name_bwd``: a handler reads that last residual, redistributes each output
  gradient to the placement the forward's output had (a ``Partial`` output
  takes a ``Replicate`` gradient), runs ``Name_bwd`` on the local tensors and
  wraps each input gradient with the transpose of its input's placement:
  ``Shard(d)`` stays ``Shard(d)``, ``Partial`` becomes ``Replicate``, and
  ``Replicate`` becomes ``Partial("sum")`` on a mesh dimension where some
  output is not ``Replicate`` (each rank's local backward is that rank's
  share of the gradient), else stays ``Replicate``. This is exact for the
  local-shards semantics a rule states (the Function run on each rank's
  shards gives that rank's shard or share of the outputs).

Registration is lazy about torch.distributed: nothing is imported until a
rule is registered. In-place (``mark_dirty``) overloads get no handlers. A rule given for a class applies to the overloads it has
and to those later calls define (its ops under ``auto()`` too); one given for
a C++ op applies to that overload (or to every overload of a packet).
Without a rule, ``Cls.apply`` on DTensors raises an error that names this
call, and ``auto()`` runs such a call as the stock Function (that call only:
the class stays an op for plain tensors; Note [Auto fall-back]); both in
eager code and where Dynamo meets the call (integrations/dynamo.py). Under
torch.compile the handlers run on DTensors of fake tensors, as DTensor's own
rules do, so a compiled call with a rule keeps the op.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Callable, Union

import torch

from .._native import _C
from ..errors import UnsupportedError

POINTWISE = "pointwise"

# class -> rule, for Python Functions (their overloads may be defined later)
_CLASS_RULES: "weakref.WeakKeyDictionary[type, object]" = weakref.WeakKeyDictionary()
# the specs a Name_fwd call chose, read back by its Name_bwd (the last residual holds the index)
_CHOICES: list = []
_CHOICE_INDEX: dict = {}
_CHOICE_LOCK = threading.Lock()


def _dtensor_type():
    """DTensor, if torch.distributed.tensor was imported (no import here)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def has_dtensor(values) -> bool:
    """Whether any argument (or element of a list argument) is a DTensor."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    for v in values:
        items = v if isinstance(v, (list, tuple)) else (v,)
        if any(isinstance(t, dtensor) for t in items):
            return True
    return False


def has_rule(cls: type) -> bool:
    return cls in _CLASS_RULES


def refuse_without_rule(fn, values) -> None:
    """``before_call`` (Note [Extension points]): a wrapped class called with
    DTensor arguments and no rule is refused."""
    if has_dtensor(values) and not has_rule(fn.cls):
        raise missing_rule_error(fn.display_name)


def missing_rule_error(display_name: str) -> UnsupportedError:
    return UnsupportedError(
        f"torch_opaque: {display_name} was called with DTensor arguments, but its op has no "
        f"sharding rule: DTensor cannot see into an opaque op (Note [Sharding opaque ops]). "
        f"Say how it shards once, with torch_opaque.register_sharding({display_name}, rule) "
        f"(rule as for torch.distributed.tensor.experimental.register_sharding), or "
        f"torch_opaque.register_sharding({display_name}, 'pointwise') to run the Function "
        f"on the local shards."
    )


# ---- the public call ------------------------------------------------------------------


def register_sharding(target, rule: Union[str, Callable]) -> None:
    """How an opaque op shards on DTensor inputs, for its whole family
    (``Name``, ``Name_fwd``, ``Name_bwd``): Note [Sharding opaque ops].

    ``target``: a torch.autograd.Function subclass (wrapped or not: under
    ``auto()`` its ops get the rule too), or an opaque op (an OpOverload or
    packet, e.g. a C++ op ``torch.ops.my_ns.Name``). ``rule``: ``"pointwise"``,
    or a function as ``torch.distributed.tensor.experimental.register_sharding``
    takes for the op's schema. Registering again replaces the rule.

    Example (a column-parallel linear, as ``ColwiseParallel`` shards it)::

        from torch.distributed.tensor import Replicate, Shard

        def linear_rule(x, w, b):
            return [
                ([Replicate()], [Replicate(), Replicate(), Replicate()]),
                ([Shard(x.ndim - 1)], [Replicate(), Shard(0), Shard(0)]),
            ]

        torch_opaque.register_sharding(MyLinear, linear_rule)
    """
    _check_rule(rule)
    if isinstance(target, type):
        if not issubclass(target, torch.autograd.Function):
            raise TypeError(
                f"torch_opaque.register_sharding: expected a torch.autograd.Function subclass or "
                f"an opaque op, got the class {target.__qualname__}."
            )
        _CLASS_RULES[target] = rule
        from .._impl.registry import lookup

        fn = lookup(target)
        for ov in list(fn.overloads.values()) if fn is not None else ():
            install_for_overload(ov)
        return
    for main, fwd, bwd, fn in _families(target):
        if fn is not None:  # a Python Function's op: the rule is its class's
            register_sharding(fn.cls, rule)
        else:
            _install(main, fwd, bwd, rule)


def _check_rule(rule) -> None:
    if rule == POINTWISE or (callable(rule) and not isinstance(rule, str)):
        return
    raise TypeError(
        f"torch_opaque.register_sharding: rule must be 'pointwise' or a function of the op's "
        f"arguments returning (output placements, input placements) pairs (as for "
        f"torch.distributed.tensor.experimental.register_sharding), got {rule!r}."
    )


def _families(target) -> list:
    """(Name, Name_fwd, Name_bwd, OpaqueFunction or None) for each overload ``target`` names."""
    from ..ops import opaque_info

    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    else:
        overloads = [target]
    found = []
    for o in overloads:
        info = opaque_info(o)
        if info is None:
            raise TypeError(
                f"torch_opaque.register_sharding: {target!r} is not an opaque op (an op of a "
                f"wrapped Function or of torch_opaque/op.h). Pass the Function class or its op."
            )
        found.append(
            (info.overload_of("op"), info.overload_of("fwd"), info.overload_of("bwd"), info.function)
        )
    return found


def install_for_overload(ov) -> None:
    """The class's rule, if any, for a (new) overload of a Python Function."""
    cls = ov.fn.cls_ref()
    rule = _CLASS_RULES.get(cls) if cls is not None else None
    if rule is None or ov.dirty:
        return
    _install(ov.op, ov.fwd_op, ov.bwd_op, rule)
    if hasattr(ov, "_own_references"):  # installed after definition: Note [Ops that graphs hold]
        ov._own_references = ov._references()


def forget(ov) -> None:
    """Drop DTensor's entries for a released overload's ops."""
    if _dtensor_type() is None:
        return
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    for op in (ov.op, ov.fwd_op, ov.bwd_op):
        dispatcher._custom_op_handlers.pop(op, None)
        prop.op_strategy_funcs.pop(op, None)
        prop.op_to_schema_info.pop(op, None)


# ---- installing a rule ------------------------------------------------------------------


def _install(main, fwd, bwd, rule) -> None:
    if not torch.distributed.is_available():
        raise RuntimeError(
            "torch_opaque.register_sharding: this torch is built without torch.distributed, "
            "so there are no DTensors to shard; install a torch build with distributed support."
        )
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import register_sharding as dtensor_rule

    fn = _pointwise_rule(main) if rule == POINTWISE else rule
    dtensor_rule(main)(fn)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[fwd] = _ForwardHandler(main)
    handlers[bwd] = _backward_handler
    # a replaced rule: no cached strategy of the old one (Python's cache and the C++ fast path's)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def _pointwise_rule(main) -> Callable:
    n_out = len(main._schema.returns)

    def pointwise(*args, **kwargs):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        values = list(args) + list(kwargs.values())
        ndims = {a.ndim for a in values if isinstance(a, DTensorSpec)}

        def each(p):
            return [p] * n_out, [p if isinstance(a, DTensorSpec) else None for a in values]

        strategies = [each(Replicate())]
        if len(ndims) == 1:
            strategies += [each(Shard(d)) for d in range(ndims.pop())]
        return strategies

    return pointwise


def _positional(op, args, kwargs) -> list:
    """All of ``op``'s arguments by position, with the defaults the dispatcher left out."""
    out = list(args)
    for a in op._schema.arguments[len(out):]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TypeError(f"torch_opaque: {op} called without its argument '{a.name}'")
    return out


def _replicated(mesh, local: torch.Tensor):
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def _remember(choice) -> int:
    """The index of a forward's choice of specs (one entry per distinct choice:
    meshes, placements and global shapes seen, for the process)."""
    index = _CHOICE_INDEX.get(choice)
    if index is None:
        with _CHOICE_LOCK:
            index = _CHOICE_INDEX.get(choice)
            if index is None:
                _CHOICES.append(choice)
                index = _CHOICE_INDEX[choice] = len(_CHOICES) - 1
    return index


class _ForwardHandler:
    """DTensor's handler of ``Name_fwd`` (Note [Sharding opaque ops])."""

    def __init__(self, main):
        self.main = main
        self.n_args = len(main._schema.arguments)

    def __call__(self, fwd, args, kwargs):
        from torch.distributed.tensor import DTensor
        from torch.utils import _pytree as pytree

        values = _positional(fwd, args, kwargs)
        main_args, needs = tuple(values[: self.n_args]), values[self.n_args]
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(self.main, main_args, {})
        sharding = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
        chosen = info.schema
        if sharding.needs_redistribute:
            dispatcher.redistribute_local_args(
                info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
            )
            chosen = sharding.redistribute_schema
        local = info.local_args
        if info.args_tree_spec is not None:
            local = pytree.tree_unflatten(list(local), info.args_tree_spec)
        *outs, saved = fwd(*local, needs)
        out_specs = sharding.output_spec
        out_specs = tuple(out_specs) if isinstance(out_specs, (list, tuple)) else (out_specs,)
        mesh = info.compute_mesh
        in_specs = tuple(
            tuple(s) if isinstance(s, list) else s for s in chosen.args_schema
        )
        index = _remember((mesh, in_specs, out_specs))
        device = next((t.device for t in info.local_args if isinstance(t, torch.Tensor)), None)
        marker = torch.tensor([index], dtype=torch.int64, device=device)
        wrapped = [DTensor(o, s, requires_grad=False) for o, s in zip(outs, out_specs)]
        residuals = [None if r is None else _replicated(mesh, r) for r in saved]
        # Saved arguments are the caller's DTensors: those redistributed here are
        # saved as the local tensors the forward saw instead (as residuals).
        moved = []
        for i, item, t in _redistributed(info.schema.args_schema, chosen.args_schema, local):
            moved.append((i, item, len(residuals)))
            residuals.append(_replicated(mesh, t))
        _C.reroute_forward_record(moved, len(residuals))
        return (*wrapped, residuals + [_replicated(mesh, marker)])


def _redistributed(before_specs, after_specs, local_args):
    """(argument index, list item or -1, local tensor) of each tensor argument
    whose spec the forward handler changed."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    for i, (before, after) in enumerate(zip(before_specs, after_specs)):
        if isinstance(before, (list, tuple)):
            for item, (b, a) in enumerate(zip(before, after)):
                if isinstance(b, DTensorSpec) and b != a:
                    yield i, item, local_args[i][item]
        elif isinstance(before, DTensorSpec) and before != after:
            yield i, -1, local_args[i]


def _grad_placements(placements) -> tuple:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _input_grad_placements(placements, out_specs) -> tuple:
    from torch.distributed.tensor import Partial, Replicate

    result = []
    for dim, p in enumerate(placements):
        if p.is_partial():
            result.append(Replicate())
        elif p.is_replicate():
            spread = any(
                s is not None and not s.placements[dim].is_replicate() for s in out_specs
            )
            result.append(Partial("sum") if spread else Replicate())
        else:
            result.append(p)
    return tuple(result)


def _backward_handler(bwd, args, kwargs):
    """DTensor's handler of ``Name_bwd`` (Note [Sharding opaque ops])."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    saved, grads, needs, state, state_ints = _positional(bwd, args, kwargs)
    marker = saved[-1]
    if not isinstance(marker, DTensor):
        raise RuntimeError(
            f"torch_opaque: {bwd} got DTensor arguments but residuals that its forward's "
            f"DTensor handler did not make (Note [Sharding opaque ops])."
        )
    mesh, in_specs, out_specs = _CHOICES[int(marker._local_tensor.item())]
    local_saved = [s._local_tensor if isinstance(s, DTensor) else s for s in saved[:-1]]
    local_grads = []
    for g, spec in zip(grads, out_specs):
        if isinstance(g, DTensor):
            target = _grad_placements(spec.placements)
            if tuple(g.placements) != target:
                g = g.redistribute(mesh, target)
            g = g._local_tensor
        local_grads.append(g)
    result = bwd(local_saved, local_grads, needs, state, state_ints)
    wrapped = []
    for g, spec in zip(result, in_specs):
        if g is None or not isinstance(spec, DTensorSpec):
            wrapped.append(g)
            continue
        placements = _input_grad_placements(spec.placements, out_specs)
        shape = spec.tensor_meta.shape
        grad_spec = DTensorSpec(
            mesh, placements, tensor_meta=TensorMeta(shape, _contiguous(shape), g.dtype)
        )
        wrapped.append(DTensor(g, grad_spec, requires_grad=False))
    return wrapped


def _contiguous(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def auto_call_runs_stock(cls: type, values) -> bool:
    """auto(): whether this call runs as the stock Function: DTensor arguments
    and no rule for ``cls`` (that call only; said once per class)."""
    if not has_dtensor(values) or has_rule(cls):
        return False
    from .._impl import auto_state as auto

    reason = (
        "it is called with DTensor arguments and has no sharding rule "
        "(torch_opaque.register_sharding; Note [Sharding opaque ops]); calls on plain tensors "
        "stay the op"
    )
    for report in auto._reports():
        report.fallbacks.setdefault(cls, reason)
    if cls not in _WARNED:
        _WARNED.add(cls)
        import warnings

        warnings.warn(
            f"torch_opaque.auto(): {cls.__qualname__} runs as an ordinary autograd.Function for "
            f"this call because {reason}.",
            stacklevel=auto._user_stacklevel(),
        )
    return True


_WARNED: "weakref.WeakSet[type]" = weakref.WeakSet()
