"""The runners of a wrapped Function's forward and backward.

The C++ bridge runs the real (eager) kernels itself, reading the callables
from these objects (Note [Python kernels] in csrc/python/python_kernel.h).
Their ``__call__`` is the same work in Python, for callers that must trace it:
the ops' fake kernels (which report the forward record through
``_C.set_forward_record``, Note [Forward record] in
include/torch_opaque/forward_record.h), graph passes and ONNX.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from . import _C
from .context import BackwardContext, ForwardContext, decode_state, encode_state
from .context import user_attributes
from .errors import FakeForwardError, SchemaError, UnsupportedError

_is_alias_of = torch._C._is_alias_of




def fake_forward_error(fn_name: str, err: BaseException) -> FakeForwardError:
    return FakeForwardError(
        f"torch_opaque: {fn_name}.forward cannot run on fake tensors while tracing "
        f"({type(err).__name__}: {err}). Tracing (torch.export, torch.compile) needs the "
        f"output shapes without real data: add a `fake` staticmethod to {fn_name} with the "
        f"same signature as forward that computes outputs of the right shape and dtype "
        f"(and saves the same tensors), e.g.\n"
        f"    @staticmethod\n"
        f"    def fake(ctx, x):\n"
        f"        ctx.save_for_backward(x)\n"
        f"        return torch.empty_like(x)"
    )


def check_tensor_outputs(fn_name: str, outs: tuple) -> None:
    if not outs:
        raise SchemaError(
            f"torch_opaque: {fn_name}.forward returned no tensors; an opaque op needs at "
            f"least one output."
        )
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            raise SchemaError(
                f"torch_opaque: {fn_name}.forward returned a {type(o).__name__} as output {k}; "
                f"opaque ops return tensors only. Return a tensor (e.g. torch.tensor(value)) "
                f"or keep this Function unwrapped."
            )


class Runner:
    """Calls the user's forward with a ForwardContext.

    The real kernel of `_fwd` runs in C++ (Note [Python kernels] in
    csrc/python/python_kernel.h): it reads ``forward``, ``setup_context``,
    ``n_out``, ``no_grad`` and ``convs`` from this object and calls
    ``convert_args``, ``outputs`` and ``encode_ctx`` for the rare paths.
    ``__call__`` is the same forward in Python, for callers that trace it
    (fake kernels, graph passes, ONNX); with ``in_python`` set it also turns
    grad mode off and copies outputs that alias inputs, as the C++ kernel does.
    """

    in_python = False

    def __init__(self, fn_name: str, forward: Callable, setup_context, specs, n_out: int):
        self.fn_name = fn_name
        self.forward = forward
        self.setup_context = setup_context
        self.specs = specs
        self.n_args = len(specs)
        self.n_out = n_out
        self.convs = [(i, s.convert) for i, s in enumerate(specs) if s.convert]
        self.tensor_pos = [i for i, s in enumerate(specs) if s.is_tensor]
        self.list_pos = [i for i, s in enumerate(specs) if s.type.startswith("Tensor[")]
        self.no_grad = (False,) * self.n_args

    def convert_args(self, args) -> tuple:
        """Kernel argument values -> the values forward expects (schema converters)."""
        args = list(args)
        for i, conv in self.convs:
            if args[i] is not None:
                args[i] = conv(args[i])
        return tuple(args)

    def encode_ctx(self, ctx: ForwardContext) -> tuple:
        """(state, state ints, saved tensors) of a ctx with user attributes: tensor
        attributes are appended to the saved tensors (Note [Context state])."""
        saved = list(ctx._to_save)
        state, ints = encode_state(self.fn_name, user_attributes(ctx), saved)
        return state, ints, saved

    def call_user(self, ctx, args, grad_off=True):
        if not (grad_off and self.in_python):
            return self._call(ctx, args)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._call(ctx, args)
        finally:
            torch._C._set_grad_enabled(prev)

    def _call(self, ctx, args):
        if self.setup_context is None:
            return self.forward(ctx, *args)
        out = self.forward(*args)
        self.setup_context(ctx, tuple(args), out)
        return out

    def outputs(self, out) -> tuple:
        if self.n_out == 1 and type(out) is torch.Tensor:
            return (out,)
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != self.n_out:
            raise RuntimeError(
                f"torch_opaque: {self.fn_name}.forward returned {len(outs)} outputs, but its "
                f"op was defined with {self.n_out} (from the first call or the return "
                f"annotation). A wrapped Function must always return the same number of "
                f"tensors for the same kinds of arguments."
            )
        check_tensor_outputs(self.fn_name, outs)
        return outs

    def __call__(self, needs, *args):
        """The real kernel, called by the C++ bridge (Note [Python kernels]):
        returns the outputs, the residuals and the record (None when `needs` is
        None, i.e. nothing is recorded for autograd)."""
        if self.convs:
            args = list(args)
            for i, conv in self.convs:
                if args[i] is not None:
                    args[i] = conv(args[i])
        ctx = ForwardContext(self.fn_name, needs if needs is not None else self.no_grad)
        outs = self.outputs(self.call_user(ctx, args))
        if self.in_python:
            outs = _unalias(outs, list(args_tensors(args, self)))
        if needs is None:
            return (*outs, [], None)
        residuals, record = self.record(ctx, args, outs)
        return (*outs, residuals, record)

    def complete(self, args, kwargs) -> list:
        """All arguments by position: callers (fake-kernel dispatch, torch.ops with
        keywords) may pass some by keyword or leave schema defaults out."""
        args = list(args)
        for spec in self.specs[len(args) :]:
            if spec.name in kwargs:
                args.append(kwargs[spec.name])
            elif spec.default is not inspect.Parameter.empty:
                args.append(spec.default)
            else:
                raise TypeError(f"{self.fn_name}: missing argument '{spec.name}'")
        return args

    def record(self, ctx: ForwardContext, args: Sequence[Any], outs: tuple) -> tuple:
        """(residual tensors, forward record as the arguments of
        _C.set_forward_record)."""
        non_diff = [any(o is t for t in ctx._non_diff) for o in outs] if ctx._non_diff else []
        if not ctx.__dict__ and not self.list_pos:
            spec = self._simple_spec(ctx._to_save, args, outs)
            if spec is not None:
                return [], (spec, non_diff, ctx._materialize, "", [])
        refs = {}
        for i in self.tensor_pos:
            t = args[i]
            if t is not None:
                refs.setdefault(id(t), (1, i, 0))
        for i in self.list_pos:
            for j, t in enumerate(args[i]):
                refs.setdefault(id(t), (2, i, j))
        for k, o in enumerate(outs):
            refs[id(o)] = (3, k, 0)
        saved = list(ctx._to_save)
        attrs = user_attributes(ctx)
        state, ints = encode_state(self.fn_name, attrs, saved) if attrs else ("", [])
        spec: list = []
        residuals: list = []
        for t in saved:
            if t is None:
                spec += (0, 0, 0)
                continue
            ref = refs.get(id(t))
            if ref is None:
                if self.in_python and any(
                    _is_alias_of(t, x) for x in (*args_tensors(args, self), *outs)
                ):
                    t = t.clone()
                ref = (4, len(residuals), 0)
                refs[id(t)] = ref
                residuals.append(t)
            spec += ref
        return residuals, (spec, non_diff, ctx._materialize, state, ints)

    def _simple_spec(self, to_save, args, outs):
        """The saved spec when every saved tensor is an input or an output (or
        None); None otherwise."""
        spec: list = []
        for t in to_save:
            if t is None:
                spec += (0, 0, 0)
                continue
            for k, o in enumerate(outs):
                if o is t:
                    spec += (3, k, 0)
                    break
            else:
                for i in self.tensor_pos:
                    if args[i] is t:
                        spec += (1, i, 0)
                        break
                else:
                    return None
        return spec


def args_tensors(args, runner: Runner):
    for i in runner.tensor_pos:
        if args[i] is not None:
            yield args[i]
    for i in runner.list_pos:
        yield from args[i]


def _unalias(outs: tuple, inputs: list) -> tuple:
    """Operator outputs may not alias inputs or each other: copy those that do."""
    fixed = None
    for k, o in enumerate(outs):
        if o is None:
            continue
        if any(_is_alias_of(o, x) for x in inputs) or any(
            x is not None and _is_alias_of(o, x) for x in outs[:k]
        ):
            if fixed is None:
                fixed = list(outs)
            fixed[k] = o.clone()
    return outs if fixed is None else tuple(fixed)


class FakeRunner(Runner):
    """The forward on fake tensors: the user's ``fake`` if given, else forward.

    PyTorch calls it from Python as the fake kernel of `_fwd` (with the
    arguments as the caller passed them), so it reads needs_input_grad from
    its arguments and reports the record to the C++ core itself.
    """

    in_python = True

    def __call__(self, *args, **kwargs):
        # As the fake kernel of `_fwd`, the last argument is needs_input_grad
        # (Note [needs_input_grad of _fwd], csrc/opaque_op.cpp); as the fake
        # kernel of the op itself there is none.
        needs = kwargs.pop("needs_input_grad", None)
        if len(args) > self.n_args:
            needs = args[self.n_args]
            args = args[: self.n_args]
        if needs is not None:
            needs = tuple(needs)
        if kwargs or len(args) != self.n_args:
            args = self.complete(args, kwargs)
        *outs, residuals, record = Runner.__call__(self, needs, *args)
        if record is not None:
            _C.set_forward_record(*record)
        return (*outs, residuals)

    def __init__(self, *a, has_user_fake: bool, **k):
        super().__init__(*a, **k)
        self.has_user_fake = has_user_fake

    def call_user(self, ctx, args, grad_off=True):
        try:
            return super().call_user(ctx, args, grad_off)
        except (FakeForwardError, SchemaError, UnsupportedError):
            raise
        except Exception as e:
            if self.has_user_fake:
                raise
            raise fake_forward_error(self.fn_name, e) from e


class InferenceFake:
    """Fake kernel of the main op: outputs only."""

    def __init__(self, runner: FakeRunner):
        self.runner = runner

    def __call__(self, *args):
        outs = self.runner(*args)[:-1]
        return outs[0] if len(outs) == 1 else outs


class BackwardRunner:
    """Calls the user's backward with a BackwardContext.

    The real kernel of `_bwd` runs in C++ (Note [Python kernels]) and uses
    ``backward``, ``tensor_flags``, ``decode_ctx`` and the error helpers;
    ``__call__`` is its Python twin for fake kernels and graph passes.
    """

    in_python = False  # no copies of gradients that alias inputs

    def __init__(self, fn_name: str, backward: Callable, specs):
        self.fn_name = fn_name
        self.backward = backward
        self.specs = specs
        self.n_args = len(specs)
        self.tensor_flags = tuple(s.is_tensor for s in specs)

    def __call__(self, saved, grads, needs_input_grad, state, state_ints):
        if state:
            n_explicit, attrs = decode_state(state, saved, state_ints)
            saved = saved[:n_explicit]
        else:
            attrs = None
        ctx = BackwardContext(self.fn_name, tuple(saved), tuple(needs_input_grad), attrs)
        res = self.backward(ctx, *grads)
        if type(res) is not tuple:
            res = (res,)
        if len(res) != self.n_args:
            res = self._fix_count(res)
        for g, is_tensor in zip(res, self.tensor_flags):
            if g is not None and not (is_tensor and isinstance(g, torch.Tensor)):
                self._raise_bad_gradients(res)
        if self.in_python:
            # Op outputs must not alias op inputs (a backward often returns grad itself).
            res = _unalias(res, [t for t in (*saved, *grads) if t is not None])
        return (res,)

    @staticmethod
    def decode_ctx(state: str, saved: tuple, state_ints) -> tuple:
        """(explicitly saved tensors, attributes) from `_bwd`'s state arguments."""
        n_explicit, attrs = decode_state(state, saved, state_ints)
        return tuple(saved[:n_explicit]), attrs

    def _fix_count(self, res):
        if len(res) > self.n_args and all(r is None for r in res[self.n_args :]):
            return res[: self.n_args]
        raise RuntimeError(
            f"torch_opaque: {self.fn_name}.backward returned an incorrect number of "
            f"gradients (expected {self.n_args}, got {len(res)}). Return one "
            f"gradient (or None) per forward argument."
        )

    def _raise_bad_gradients(self, res):
        for i, g in enumerate(res):
            if g is None:
                continue
            spec = self.specs[i]
            if not spec.is_tensor:
                raise RuntimeError(
                    f"torch_opaque: {self.fn_name}.backward returned a gradient different "
                    f"than None at position {i + 1}, but the corresponding forward input "
                    f"'{spec.name}' is not a Tensor. Return None there."
                )
            if not isinstance(g, torch.Tensor):
                raise TypeError(
                    f"torch_opaque: {self.fn_name}.backward returned a {type(g).__name__} at "
                    f"position {i + 1}; gradients must be tensors or None."
                )


class FakeBackwardRunner(BackwardRunner):
    in_python = True


def make_backward_fake(runner: BackwardRunner, fn_name: str) -> Callable:
    runner = FakeBackwardRunner(runner.fn_name, runner.backward, runner.specs)

    def fake_backward(saved, grads, needs_input_grad, state, state_ints):
        try:
            return list(runner(saved, grads, needs_input_grad, state, state_ints)[0])
        except Exception as e:
            raise RuntimeError(
                f"torch_opaque: {fn_name}.backward cannot run on fake tensors while tracing "
                f"a training graph ({type(e).__name__}: {e}). Write the backward with "
                f"torch operations (no numpy, .item() or data-dependent Python), or trace "
                f"for inference only (torch.no_grad / torch.export)."
            ) from e

    return fake_backward
