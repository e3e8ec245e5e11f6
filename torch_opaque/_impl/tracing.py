"""What every Python caller that traces an opaque call needs, once: a size for
a symbolic dimension, real-shaped stand-ins for traced values, a plain
sample of a torch.func-wrapped tensor, copies of outputs that alias inputs,
and one "trace this kind of call to ATen".

Used by the first-call probe (opaque_function.py), auto() (_impl/auto_mode.py), graph
passes, stored programs (archive/) and ONNX export (onnx/).

Note [Tracing a call kind to ATen]
Self-contained archives (archive/trace.py) and ONNX functions (onnx/functions.py)
both need the user's forward of one kind of call (argument dtypes, constants,
which sizes are static), and its backward, as ATen programs. Both describe the
call by a :class:`CallTemplate` (per schema argument: a tensor, a tensor list,
None, a symbolic int, a list of symbolic ints or a constant), run the forward
through :class:`ForwardTrace` and the backward through :class:`BackwardTrace`,
and trace them with :func:`trace_to_aten` (``torch.export``, non-strict, one
list input). The forward runs through a runner: the overload's
``kernels.Runner`` for a Python Function (the same C++ run as the real kernel,
Note [Python kernels]), ``cpp_kernels.CppRunner`` for an op defined in C++ (its
own kernels, below autograd: Note [Kernels below autograd]). ``_fwd``'s
trailing needs_input_grad is told apart by the runner's
:class:`~.calls.CallSignature`. The backward is any callable with ``_bwd``'s
arguments returning one gradient or None per forward argument
(``kernels.BackwardRunner``, ``cpp_kernels.CppBackward``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

# Note [User bodies run without Dynamo]
# torch_opaque runs the user's forward, ``fake`` and backward itself to make
# fake kernels, probe a first call's outputs and trace call kinds to ATen
# (archives, ONNX). Those bodies may be ``torch.compile``d, or call compiled
# helpers (transformers' BitNet ``WeightQuant`` decorates its forward with
# ``@torch.compile``). A compiled function called on fake tensors outside a
# Dynamo trace runs its compiled kernels on them: Inductor's C++ kernels read
# the fakes' (null) data pointers and the process crashes, aot_eager's raise.
# So every such run is inside :func:`dynamo_disabled`, which sets Dynamo's
# stance to "force_eager" (what ``torch.compiler.set_stance("force_eager")``
# sets): a compiled function then calls its original Python, which runs on
# fakes like any forward, and a Dynamo or export trace around the call sees
# its ATen ops. The stance is set directly (``eval_frame._stance``), since
# the public setter refuses while a compile region is active, which is when
# Dynamo runs fake kernels. The stance is process-wide: another thread
# calling a compiled function meanwhile runs it eagerly (same values). Real
# kernels (eager calls of the op) keep running the compiled forward, as
# stock autograd.Function does.


@contextlib.contextmanager
def dynamo_disabled() -> Iterator[None]:
    """Compiled functions called inside run their original Python (Note [User
    bodies run without Dynamo])."""
    ef = sys.modules.get("torch._dynamo.eval_frame")
    prior = getattr(ef, "_stance", None)
    if prior is None or prior.stance == "force_eager":  # Dynamo not loaded: nothing compiled
        yield
        return
    ef._stance = ef.DynamoStance("force_eager", prior.skip_guard_eval_unsafe, prior.backend)
    try:
        yield
    finally:
        ef._stance = prior


# The size given to a symbolic dimension whose hint is unknown (an unbacked
# size, or one the shape environment cannot evaluate). Not 0 or 1, which
# torch.export specializes, and not 2, the smallest size it keeps symbolic, so
# that it is unlikely to equal a static size by accident.
FALLBACK_SIZE_HINT = 4


def size_hint(v: Any) -> int:
    """An int for a size: the size itself, its hint, or one that satisfies the
    symbol's range where the shape environment knows it."""
    if not isinstance(v, torch.SymInt):
        return int(v)
    node = v.node
    h = getattr(node, "hint", None)
    if h is not None:
        return int(h)
    env = getattr(node, "shape_env", None)
    if env is not None:
        try:
            h = env.size_hint(node.expr, allow_none=True)
        except Exception:  # the shape environment's own evaluation errors
            h = None
        if h is not None:
            return int(h)
        import sympy  # here, not at module level: importing sympy costs ~0.25 s (#11)

        subs = {}
        for s in node.expr.free_symbols:
            vr = env.var_to_range.get(s)
            # (torch's infinite bounds, int_oo, say they are finite: ask for an Integer)
            lo = int(vr.lower) if vr is not None and isinstance(vr.lower, sympy.Integer) else 2
            subs[s] = max(lo, 2)  # 2: the smallest size torch.export keeps symbolic
        try:
            return int(node.expr.xreplace(subs))
        except Exception:  # an expression that does not reduce to a number
            pass
    return FALLBACK_SIZE_HINT


def real_shaped(v: Any) -> Any:
    """``v`` with symbolic sizes replaced by their hints: tensors become empty
    tensors of the hinted shape and strides (made in the current mode),
    sequences are converted item by item, SymInts become ints."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(
            [size_hint(s) for s in v.shape],
            [size_hint(s) for s in v.stride()],
            dtype=v.dtype,
            device=v.device,
        )
    if isinstance(v, torch.Size):
        return torch.Size(size_hint(x) for x in v)
    if isinstance(v, (list, tuple)):
        return type(v)(real_shaped(x) for x in v)
    if isinstance(v, torch.SymInt):
        return size_hint(v)
    return v


def one_plain_sample(v: Any) -> Any:
    """A torch.func (vmap, grad, jvp) wrapped tensor's plain tensor (one sample
    of a vmapped one): the output probe of a first call inside a transform runs on it."""
    F = torch._C._functorch
    while isinstance(v, torch.Tensor) and F.is_functorch_wrapped_tensor(v):
        if F.is_batchedtensor(v):  # one sample
            v = F.get_unwrapped(v).select(F.maybe_get_bdim(v), 0)
        else:
            v = F.get_unwrapped(v)
    return v


def unalias(outs: Sequence, inputs: Sequence) -> tuple:
    """Operator outputs may not alias inputs or each other: a copy of each that
    shares storage with an input or an earlier output (views included), as the
    C++ finishers make for the real kernels (Note [One forward finisher] in
    include/torch_opaque/detail/finishers.h)."""
    fixed = None
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            continue
        if any(isinstance(x, torch.Tensor) and torch._C._is_alias_of(o, x) for x in inputs) or any(
            isinstance(x, torch.Tensor) and torch._C._is_alias_of(o, x) for x in outs[:k]
        ):
            if fixed is None:
                fixed = list(outs)
            fixed[k] = o.clone()
    return tuple(outs) if fixed is None else tuple(fixed)


# ---- tracing one kind of call to ATen (Note [Tracing a call kind to ATen]) --------------


class CallTemplate:
    """How a call's arguments, in schema order, come from a flat list of traced
    inputs (tensors, then symbolic ints). ``slots``, per argument: ``("T",)`` a
    tensor, ``("L", n)`` a list of n tensors, ``("O", nones)`` a ``Tensor?[]``
    (None where ``nones`` says), ``("N",)`` a None tensor, ``("I",)`` a symbolic
    int, ``("IL", n)`` a list of n symbolic ints, ``("C", value)`` a constant.

    Example::

        >>> import torch
        >>> from torch_opaque._impl.tracing import CallTemplate
        >>> t = CallTemplate([("T",), ("C", 2.0), ("O", (False, True)), ("I",)])
        >>> a, b = torch.ones(1), torch.zeros(1)
        >>> t.rebuild([a, b, 5])
        [tensor([1.]), 2.0, [tensor([0.]), None], 5]
    """

    __slots__ = ("slots",)

    def __init__(self, slots: Sequence[tuple]):
        self.slots = tuple(slots)

    def rebuild(self, flat: Sequence) -> list:
        """The call's arguments from its traced inputs."""
        tensors = iter([x for x in flat if isinstance(x, torch.Tensor)])
        ints = iter([x for x in flat if not isinstance(x, torch.Tensor)])
        args = []
        for slot in self.slots:
            k = slot[0]
            if k == "T":
                args.append(next(tensors))
            elif k == "L":
                args.append([next(tensors) for _ in range(slot[1])])
            elif k == "O":
                args.append([None if none else next(tensors) for none in slot[1]])
            elif k == "N":
                args.append(None)
            elif k == "I":
                args.append(next(ints))
            elif k == "IL":
                args.append([next(ints) for _ in range(slot[1])])
            else:
                args.append(slot[1])
        return args


def requiring_grad(flat: Sequence, flags: Optional[Sequence[bool]]) -> list:
    """``flat`` with the tensors ``flags`` marks made to require grad, inside the
    trace: each a detached leaf of the traced input (torch.export's own
    placeholders requiring grad leak fake tensors into the program's constants
    when a body differentiates with respect to them)."""
    flat = list(flat)
    if flags is None:
        return flat
    return [x.detach().requires_grad_() if f else x for x, f in zip(flat, flags)]


class ForwardTrace(torch.nn.Module):
    """The user's forward for one kind of call, as a module torch.export traces:
    ``flat`` (tensors, then symbolic ints) -> outputs, and when the call is
    recorded its residuals and state ints too.

    ``runner``: the overload's ``kernels.Runner`` (the C++ run of the real
    kernel, which copies outputs that alias inputs; grad mode is left alone, as
    tracing requires). needs_input_grad is the rebuilt call's own trailing one
    (a ``Name_fwd`` call), else ``needs`` (None: not recorded). ``report``
    receives the forward record; it is kept outside the module's state, since
    torch.export restores state reachable from the module after tracing.
    ``requires_grad``: per item of ``flat``, whether the forward sees it
    requiring grad (:func:`requiring_grad`)."""

    def __init__(self, runner, template: CallTemplate, needs: Optional[Sequence[bool]] = None,
                 report: Optional[Callable] = None, state_ints: bool = False,
                 requires_grad: Optional[Sequence[bool]] = None):
        super().__init__()
        self.runner, self.template = runner, template
        self.needs = tuple(needs) if needs is not None else None
        self._report = report
        self.state_ints = state_ints
        self.requires_grad = requires_grad

    def forward(self, flat):
        args = self.template.rebuild(requiring_grad(flat, self.requires_grad))
        args, _, needs = self.runner.signature.split_needs_input_grad(args, {})
        needs = tuple(bool(n) for n in needs) if needs is not None else self.needs
        with dynamo_disabled():
            outs, residuals, record = self.runner.run(needs, args)
        if record is None:
            return tuple(outs)
        if self._report is not None:
            self._report(record)
        return (*outs, *residuals, *(record[4] if self.state_ints else ()))


class BackwardTrace(torch.nn.Module):
    """The backward of one kind of call, as a module torch.export traces:
    ``flat`` (saved tensors, output gradients, then symbolic ints) -> the
    gradients that are not None.

    ``backward(saved, grads, needs_input_grad, state, state_ints)`` returns one
    gradient or None per forward argument; ``template`` rebuilds its five
    arguments from ``flat``. ``positions``: the arguments whose gradients the
    program returns (a gradient traced as None there is an error); None: those
    the backward returns, told to ``report`` (kept outside the module's state,
    as for :class:`ForwardTrace`). ``requires_grad``: as for :class:`ForwardTrace`."""

    def __init__(self, backward: Callable, template: CallTemplate,
                 positions: Optional[Sequence[int]] = None, report: Optional[Callable] = None,
                 requires_grad: Optional[Sequence[bool]] = None):
        super().__init__()
        self.backward, self.template = backward, template
        self.positions = tuple(positions) if positions is not None else None
        self._report = report
        self.requires_grad = requires_grad

    def forward(self, flat):
        flat = requiring_grad(flat, self.requires_grad)
        saved, grads, needs, state, state_ints = self.template.rebuild(flat)
        with dynamo_disabled():
            res = self.backward(list(saved), list(grads), list(needs), state, list(state_ints))
        positions = self.positions
        if positions is None:
            positions = tuple(i for i, g in enumerate(res) if g is not None)
        missing = [i for i in positions if res[i] is None]
        if missing:
            raise RuntimeError(
                f"the backward returned None for argument(s) {missing} when traced, but a "
                f"gradient in the program"
            )
        if self._report is not None:
            self._report(positions)
        return tuple(res[i] for i in positions)


def trace_to_aten(module: torch.nn.Module, flat: Sequence, dynamic: Sequence):
    """``module(flat)`` traced to an ATen ExportedProgram (torch.export,
    non-strict); ``dynamic``: per item of ``flat``, its dynamic dims (a dict, or
    ``torch.export.Dim`` for an int) or None."""
    return torch.export.export(module, (list(flat),), dynamic_shapes=(list(dynamic),),
                               strict=False)
