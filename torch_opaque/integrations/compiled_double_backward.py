"""Double backward through ``torch.compile``d graphs that hold opaque ops.

Note [Double backward in compiled graphs]
AOTAutograd turns a compiled region into one autograd.Function
(``CompiledFunction``, torch/_functorch/_aot_autograd/runtime_wrappers.py).
Its forward saves the partitioned graph's residuals detached, so the compiled
backward cannot be differentiated with respect to the region's inputs; when
autograd records the backward (``create_graph=True``) torch wraps it in a
Function whose backward raises "torch.compile with aot_autograd does not
currently support double backward".

For a region whose Dynamo graph calls opaque ops we do what eager autograd
would have done: under ``create_graph=True`` the region's backward replays
the Dynamo graph eagerly on the region's own input tensors, with grad mode
on, and returns ``torch.autograd.grad(outputs, inputs, grads,
create_graph=True)`` of that replay. Every operation of the replay records
its derivative: ATen ops their formulas, opaque ops their Autograd kernel,
whose ``Name_bwd`` records the user's backward (Note [Double backward] in
csrc/backward_autograd_kernel.cpp). The gradients are therefore those of
eager code, differentiable again with respect to inputs, parameters and the
incoming gradients; a ``once_differentiable`` backward raises torch's own
error when differentiated twice, as in eager code. A first-order backward
(``create_graph=False``) runs the compiled backward as before.

The replay must compute what the compiled forward computed. It is used only
when that is known to hold, and otherwise the region keeps torch's compiled
backward and torch's error on differentiating it again:
- the graph holds no higher-order op (a stock autograd.Function that Dynamo
  inlined runs eagerly as ``autograd_function_apply``, whose backward would
  not be differentiated as the Function's is: silently wrong values);
- the region's inputs reach the Function as the Dynamo graph's inputs (its
  parameters and buffers first, as aot_module_simplified passes them): no
  deduplicated or synthetic-base inputs, no tensor subclasses, no effect
  tokens, no backward state (compiled autograd's hooks);
- no input mutations (the Function's outputs are then the graph's outputs,
  followed by the bases of outputs that are views of intermediates, which
  the replay returns too; outputs that are inputs or views of inputs are
  regenerated outside the Function, which gets no gradient for them);
- no input modified in place since the forward (version counters);
- not compiled under autocast (AOTAutograd bakes its casts into the graph
  and runs it with autocast off; a replay of the Dynamo graph would not
  know which state to restore);
- the replay draws no random numbers from the default generators (CPU
  and, when initialised, CUDA): their state is compared around the replay
  and restored, so a forward with dropout or a Function that samples keeps
  torch's behaviour instead of getting gradients of different samples;
- the replay's outputs equal those the compiled forward returned (kept
  detached; compared within rounding tolerances): a safety net for what
  the checks above cannot see (a ``torch.Generator`` the user made, global
  state the forward reads, an output modified in place since).

The replay runs the forward's Python code again (side effects such as
counters or prints happen twice). Under compiled autograd the region's
backward is traced by torch (proxy_call_aot_backward), not run here:
torch's behaviour.

Cost: the region's inputs and (detached) outputs stay referenced by its
autograd node until a backward that does not keep the graph
(``retain_graph=False``) has run or the graph is freed; a double backward
runs the forward once more, eagerly.
Regions without opaque ops are untouched: the hook only acts while
aot_module_simplified compiles a graph that calls one (both ``aot_eager``
and Inductor reach it through torch._dynamo.backends.common).
"""

from __future__ import annotations

import sys
import threading
import warnings

import torch

_installed = False
_compiling = threading.local()  # .region: the _Region being compiled, if its graph is replayed


def _is_opaque_target(target) -> bool:
    from ..ops import opaque_info

    if isinstance(target, torch._ops.OpOverloadPacket):  # torch.ops.ns.name(...) in user code
        return any(opaque_info(getattr(target, o)) is not None for o in target.overloads())
    return opaque_info(target) is not None


def _replays_opaque_ops(mod) -> bool:
    """Whether the graph calls opaque ops and holds no higher-order op (a
    stock Function Dynamo inlined runs eagerly as autograd_function_apply,
    whose eager backward is not differentiable again as the Function's is)."""
    targets = [
        n.target
        for m in mod.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
    ]
    if any(isinstance(t, torch._ops.HigherOrderOperator) for t in targets):
        return False
    return any(_is_opaque_target(t) for t in targets)


class _Region:
    """What a replay needs: the Dynamo graph and its parameter/buffer names."""

    def __init__(self, mod):
        self.mod = mod
        params = dict(mod.named_parameters(remove_duplicate=False))
        buffers = dict(mod.named_buffers(remove_duplicate=False))
        self.state_names = list(params) + list(buffers)
        # The replay is eager code even when a backward runs inside a frame
        # Dynamo is compiling or evaluating.
        self.run = torch._dynamo.disable(self._run, recursive=True)

    def _run(self, inputs):
        n = len(self.state_names)
        if not n:
            return self.mod(*inputs)
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(self.mod, dict(zip(self.state_names, inputs[:n]))):
            return self.mod(*inputs[n:])


def _intermediate_bases(spec, region):
    """Where the Function built from ``spec`` returns the graph's outputs as
    they are (Note [Double backward in compiled graphs]): the list of
    (output index, base index) of the outputs whose ``._base`` it also returns
    after them (views of intermediates, regenerated outside the Function);
    None when the replay cannot stand for the Function."""
    from torch._functorch._aot_autograd.schemas import OutputType

    meta = spec.fw_metadata
    replayable = (
        spec.maybe_subclass_meta is None
        and not spec.disable_amp  # compiled under autocast: its casts are baked into the graph
        and not spec.backward_state_indices
        and spec.aot_config.num_params_buffers == len(region.state_names)
        and not getattr(meta, "tokens", None)
        and not meta.is_rng_op_functionalized
        and not any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
    )
    if not replayable:
        return None
    as_they_are = (
        OutputType.non_alias,
        OutputType.unsafe_view_alias,
        OutputType.custom_function_view,
        OutputType.alias_of_intermediate,  # its base is returned for another output
        OutputType.alias_of_intermediate_base_is_user_output,
        # regenerated from the inputs outside the Function: its own output there gets no gradient
        OutputType.alias_of_input,
        OutputType.is_input,
    )
    bases = []
    for i, o in enumerate(meta.output_info):
        if o.output_type == OutputType.alias_of_intermediate_save_as_output:
            bases.append((i, o.base_idx))
        elif o.output_type not in as_they_are:  # a kind this torch version adds
            return None
    if sorted(b for _, b in bases) != list(range(meta.num_intermediate_bases)):
        return None
    return bases


def _rng_states():
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state_all())
    return states


def _set_rng_states(states) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1])


def _same_rng_states(a, b) -> bool:
    if len(a) != len(b) or not torch.equal(a[0], b[0]):
        return False
    return len(a) == 1 or all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class _Saved:
    """The region's inputs (with their versions) and, detached, what its
    forward returned."""

    __slots__ = ("inputs", "versions", "outputs")

    def __init__(self, inputs):
        self.inputs = inputs
        self.versions = [t._version if isinstance(t, torch.Tensor) else None for t in inputs]
        self.outputs = ()

    def unchanged(self) -> bool:
        return all(
            v is None or t._version == v for t, v in zip(self.inputs, self.versions)
        )


# Tolerances for comparing the replay with the compiled forward: the compiled
# code rounds differently (fused kernels), a different computation differs by
# far more.
_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def _reproduces(replayed, saved_outputs) -> bool:
    """Whether the replay's outputs are those the compiled forward returned."""
    if len(replayed) != len(saved_outputs):
        return False
    for a, b in zip(replayed, saved_outputs):
        if not isinstance(b, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        a = a.detach()
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return False
            continue
        rtol, atol = _TOLERANCES.get(a.dtype, (1e-3, 1e-4))
        if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


def _replay_grads(region, bases, saved, grads):
    """Input gradients of the eager replay, recorded (create_graph), or None
    when the replay would not reproduce the compiled forward."""
    inputs = saved.inputs
    before = _rng_states()
    try:
        with torch.enable_grad():
            outs = region.run(inputs)
        after = _rng_states()
    finally:
        _set_rng_states(before)
    if not _same_rng_states(before, after):
        return None
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if bases:
        extra = [None] * len(bases)
        for i, b in bases:
            extra[b] = getattr(outs[i], "_base", None) if i < len(outs) else None
        if any(e is None for e in extra):
            return None
        outs += extra
    if len(outs) != len(grads) or not _reproduces(outs, saved.outputs):
        return None
    pairs = [
        (o, g)
        for o, g in zip(outs, grads)
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
    ]
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    result = [None] * len(inputs)
    if not pairs or not wanted:
        return result
    got = torch.autograd.grad(
        [o for o, _ in pairs],
        [inputs[i] for i in wanted],
        [g for _, g in pairs],
        create_graph=True,
        allow_unused=True,
    )
    for i, g in zip(wanted, got):
        result[i] = g
    return result


def _make_replayable(cls, region, bases) -> None:
    """Give the freshly built CompiledFunction class a forward that keeps its
    inputs and a backward that replays under create_graph=True."""
    compiled_forward, compiled_backward = cls.forward, cls.backward

    def forward(ctx, *args):
        saved = _Saved(args)
        outs = compiled_forward(ctx, *args)
        saved.outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else None for o in outs)
        ctx._torch_opaque_replay = saved
        return outs

    def backward(ctx, *flat_args):
        saved = getattr(ctx, "_torch_opaque_replay", None)
        if saved is not None and not torch._C._autograd._get_current_graph_task_keep_graph():
            ctx._torch_opaque_replay = None  # the graph is freed after this backward
        if saved is not None and torch.is_grad_enabled() and saved.unchanged():
            # boxed_grads_call: the gradients come as one list
            grads = flat_args[0] if len(flat_args) == 1 and isinstance(flat_args[0], list) else flat_args
            result = _replay_grads(region, bases, saved, list(grads))
            if result is not None:
                return tuple(result)
        return compiled_backward(ctx, *flat_args)

    cls.forward = staticmethod(forward)
    cls.backward = staticmethod(backward)


def _routed_aot_module_simplified(original):
    def aot_module_simplified(mod, args, *rest, **kwargs):
        if not _replays_opaque_ops(mod):
            return original(mod, args, *rest, **kwargs)
        outer = getattr(_compiling, "region", None)
        _compiling.region = _Region(mod)
        try:
            return original(mod, args, *rest, **kwargs)
        finally:
            _compiling.region = outer

    aot_module_simplified.__wrapped__ = original
    return aot_module_simplified


def _routed_build(original):
    def build(self):
        cls = original(self)
        region = getattr(_compiling, "region", None)
        bases = None if region is None else _intermediate_bases(self.spec, region)
        if bases is not None:
            _make_replayable(cls, region, bases)
        return cls

    return build


_COMMON = "torch._dynamo.backends.common"  # where aot_eager and Inductor call AOTAutograd


def _patch(common) -> None:
    from torch._functorch._aot_autograd import runtime_wrappers

    factory = getattr(runtime_wrappers, "_AOTDispatchAutogradFunctionFactory", None)
    if factory is None or not callable(getattr(common, "aot_module_simplified", None)):
        warnings.warn(  # pragma: no cover - another torch version
            f"torch_opaque: torch {torch.__version__} builds compiled autograd Functions "
            f"differently; double backward through compiled graphs holding opaque ops keeps "
            f"torch's error."
        )
        return
    common.aot_module_simplified = _routed_aot_module_simplified(common.aot_module_simplified)
    factory.build = _routed_build(factory.build)


def install() -> None:
    """Patch AOTAutograd once (called when Dynamo loads): now if
    torch._dynamo.backends.common is loaded, else when it is; a warning and
    no patch when its internals are not as expected."""
    global _installed
    if _installed:
        return
    _installed = True
    common = sys.modules.get(_COMMON)
    if common is None:
        # Importing it from the Dynamo hook could re-enter a partially imported
        # torch._inductor (torch.compile's first call imports Inductor, which
        # imports Dynamo), so the patch waits for its first import.
        from .._impl.extension_points import AfterFirstImport

        AfterFirstImport(_COMMON, _patch).arm()
    elif hasattr(common, "aot_autograd"):  # its last definition: fully imported
        _patch(common)
    else:  # pragma: no cover - imported part-way; not seen with torch 2.13/2.14
        warnings.warn(
            "torch_opaque: torch._dynamo.backends.common was being imported when Dynamo "
            "finished loading; double backward through compiled graphs holding opaque ops "
            "keeps torch's error."
        )
