"""The runners of a wrapped Function's forward and backward.

The C++ bridge runs the real (eager) kernels itself, reading the callables
from these objects (Note [Python kernels] in csrc/python/python_kernel.h).
Python callers that trace a forward or backward use the same C++ run through
``Runner.run`` and ``BackwardRunner.__call__``: the ops' fake kernels (which
report the forward record through ``_C.set_forward_record``, Note [Forward
record] in include/torch_opaque/forward_record.h), graph passes, stored
programs and ONNX.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._native import _C
from .context import ForwardContext, decode_state, encode_state, user_attributes
from ..errors import FakeForwardError, SchemaError, UnsupportedError
from .bridge import BackwardChecks, ForwardChecks
from .calls import CallSignature
from .bridge import check_tensor_outputs  # noqa: F401 (re-exported)
from . import fake_from_real, side_effects
from .tracing import dynamo_disabled


def fake_forward_error(fn_name: str, err: BaseException, why: str = "") -> FakeForwardError:
    """``why``: the reason a fake from real runs was refused too (Note [Fake
    from a real run] in fake_from_real.py)."""
    if why:
        why = (f"; its output shapes could not be learnt from runs on stand-in data "
               f"either: {why}")
    return FakeForwardError(
        f"torch_opaque: {fn_name}.forward cannot run on fake tensors while tracing "
        f"({type(err).__name__}: {err}{why}). Tracing (torch.export, torch.compile) needs the "
        f"output shapes without real data: add a `fake` staticmethod to {fn_name} with the "
        f"same signature as forward that computes outputs of the right shape and dtype "
        f"(and saves the same tensors), e.g.\n"
        f"    @staticmethod\n"
        f"    def fake(ctx, x):\n"
        f"        ctx.save_for_backward(x)\n"
        f"        return torch.empty_like(x)"
    )


class Runner(ForwardChecks):
    """Calls the user's forward with a ForwardContext.

    The real kernel of `_fwd` runs in C++ (Note [Python kernels] in
    csrc/python/python_kernel.h) and reads what bridge.ForwardRunnerProtocol
    names; ``keeps_ctx_objects`` tells it that eager calls may keep ctx
    attributes as objects and call ``encode_attrs`` later (Note [Eager context
    state] in include/torch_opaque/forward_record.h).
    ``run`` gives Python callers that trace the forward
    (fake kernels, graph passes, stored programs, ONNX) the same C++ run.
    """

    def __init__(self, fn_name: str, forward: Callable, setup_context, specs, n_out: int,
                 arg_names=None):
        self.fn_name = fn_name
        self.forward = forward
        self.setup_context = setup_context
        self.specs = specs
        self.n_args = len(specs)
        self.n_out = n_out
        self.convs = [(i, s.convert) for i, s in enumerate(specs) if s.convert]
        self.no_grad = (False,) * self.n_args
        self.arg_names = tuple(arg_names or (s.name for s in specs))
        self.signature = CallSignature.of_specs(fn_name, specs)

    keeps_ctx_objects = True

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

    def encode_attrs(self, attrs: dict, n_saved: int) -> tuple:
        """(state, state ints, tensors to append to the saved ones) of ctx
        attributes kept as objects by an eager call whose backward is being
        traced (Note [Eager context state] in include/torch_opaque/forward_record.h)."""
        saved = [None] * n_saved
        state, ints = encode_state(self.fn_name, attrs, saved)
        return state, ints, saved[n_saved:]

    def call_user(self, ctx, args):
        """The user's forward alone (no checks, no record), for learning the outputs."""
        if self.setup_context is None:
            return self.forward(ctx, *args)
        out = self.forward(*args)
        self.setup_context(ctx, tuple(args), out)
        return out

    def run_first(self, needs: tuple, args) -> tuple:
        """(what forward returned, ctx): the forward run by the C++ bridge as the
        kernel runs it (grad mode off, in-place check: Note [In-place forwards])
        while the number of outputs is unknown (Note [First call runs forward
        once] in _impl/opaque_function.py). Unchecked outputs, no record."""
        return _C.run_first_forward(self, tuple(needs), tuple(args))

    def run(self, needs, args, forward=None, setup_context=None) -> tuple:
        """(outputs, residuals, record): the forward run by the C++ bridge as the
        real kernel runs it (grad mode left as it is). `needs` None: not recorded,
        record None; otherwise record holds the arguments of _C.set_forward_record."""
        return _C.run_forward(
            self,
            forward or self.forward,
            setup_context or self.setup_context,
            needs,
            tuple(args),
        )

    def complete(self, args, kwargs) -> list:
        """All arguments by position: callers (fake-kernel dispatch, torch.ops with
        keywords) may pass some by keyword or leave schema defaults out."""
        return self.signature.complete(args, kwargs)


class FakeRunner(Runner):
    """The forward on fake tensors: the user's ``fake`` if given, else forward.

    PyTorch calls it from Python as the fake kernel of `_fwd` (with the
    arguments as the caller passed them), so it reads needs_input_grad from
    its arguments, turns grad mode off as the Autograd kernel does, and reports
    the record to the C++ core itself. Errors of a forward that cannot run on
    fake tensors become a FakeForwardError that says to add ``fake``.
    """

    def __init__(self, *a, has_user_fake: bool, **k):
        super().__init__(*a, **k)
        self.has_user_fake = has_user_fake
        self.guarded_forward = self._guard(self.forward)
        self.guarded_setup = self._guard(self.setup_context) if self.setup_context else None

    def __call__(self, *args, **kwargs):
        # As the fake kernel of `_fwd`, the last argument is needs_input_grad
        # (Note [needs_input_grad of _fwd], csrc/opaque_op.cpp); as the fake
        # kernel of the op itself there is none.
        args, kwargs, needs = self.signature.split_needs_input_grad(args, kwargs)
        if kwargs or len(args) != self.n_args:
            args = self.complete(args, kwargs)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            outs, residuals, record = self.run(
                needs, args, self.guarded_forward, self.guarded_setup
            )
        finally:
            torch._C._set_grad_enabled(prev)
        if record is not None:
            _C.set_forward_record(*record)
        return (*outs, residuals)

    def run(self, needs, args, forward=None, setup_context=None) -> tuple:
        """Runner.run; for the guarded forward (the fake kernel's run, and
        auto()'s recording check), Dynamo is off (Note [User bodies run without
        Dynamo] in tracing.py) and a forward that branches on its data gets
        outputs from real runs (Note [Fake from a real run])."""
        with self.quiet(args):  # Note [Fake runs leave no trace] (side_effects.py)
            if forward is not self.guarded_forward:
                return super().run(needs, args, forward, setup_context)
            try:
                with dynamo_disabled(), fake_from_real.discarding_fresh_unbacked(args):
                    return super().run(needs, args, forward, setup_context)
            except FakeForwardError as e:
                if not self._from_real_allowed(e):
                    raise
                return self._run_from_real(needs, args, e)

    def call_user(self, ctx, args):
        with self.quiet(args):  # Note [Fake runs leave no trace] (side_effects.py)
            try:
                with dynamo_disabled(), fake_from_real.discarding_fresh_unbacked(args):
                    return self._guard(super().call_user)(ctx, args)
            except FakeForwardError as e:
                if not self._from_real_allowed(e):
                    raise
                return self._call_user_from_real(ctx, args, e)

    def quiet(self, args):
        """The runs of this fake (fake-from-real runs included) leave no trace."""
        funcs = self.__dict__.get("_user_functions")
        if funcs is None:
            funcs = self._user_functions = side_effects.functions_of(self.forward, self.setup_context)
        return side_effects.quiet(None, args, funcs, self.arg_names)

    # ---- Note [Fake from a real run] (fake_from_real.py) ----

    def _from_real_allowed(self, err: FakeForwardError) -> bool:
        return not self.has_user_fake and fake_from_real.is_data_dependent(err)

    def _run_from_real(self, needs, args, err) -> tuple:
        """(outputs, residuals, record) of the fake kernel, from real runs."""
        plain = Runner.run

        def run(*stand_ins):
            outs, residuals, record = plain(self, needs, stand_ins, self.forward, self.setup_context)
            extra = (len(outs), None if record is None else tuple(map(_hashable, record[:4])))
            ints = [] if record is None else list(record[4])
            if needs is None:  # not recorded (the main op's fake): no residuals wanted
                residuals = []
            return [*outs, *residuals], ints, extra

        try:
            made, ints, (n_out, rec) = fake_from_real.outputs_from_real(
                run, list(args), free=self.n_out
            )
        except fake_from_real.NotShapeFollowing as why:
            raise fake_forward_error(self.fn_name, err.__cause__ or err, str(why)) from err
        record = None if rec is None else (*(list(r) if isinstance(r, tuple) else r for r in rec), ints)
        return made[:n_out], list(made[n_out:]), record

    def _call_user_from_real(self, ctx, args, err):
        """What forward returns, as fakes (the first-call probe, jvp fakes)."""
        from .context import ForwardContext

        plain = Runner.call_user
        needs = tuple(getattr(ctx, "needs_input_grad", (False,) * len(args)))

        def run(*stand_ins):
            out = plain(self, ForwardContext(self.fn_name, needs), list(stand_ins))
            outs = out if isinstance(out, tuple) else (out,)
            check_tensor_outputs(self.fn_name, outs)
            return list(outs), [], isinstance(out, tuple)

        try:
            made, _, is_tuple = fake_from_real.outputs_from_real(run, list(args))
        except fake_from_real.NotShapeFollowing as why:
            raise fake_forward_error(self.fn_name, err.__cause__ or err, str(why)) from err
        return tuple(made) if is_tuple else made[0]

    def _guard(self, fn: Callable) -> Callable:
        def guarded(*args):
            try:
                return fn(*args)
            except (FakeForwardError, SchemaError, UnsupportedError):
                raise
            except Exception as e:
                if self.has_user_fake:
                    raise
                raise fake_forward_error(self.fn_name, e) from e

        return guarded


class InferenceFake:
    """Fake kernel of the main op: outputs only."""

    def __init__(self, runner: FakeRunner, dirty=()):
        self.runner = runner
        self.dirty = {k for k, _ in dirty}  # outputs an in-place op writes into arguments

    def __call__(self, *args):
        outs = self.runner(*args)[:-1]
        if self.dirty:
            outs = tuple(o for k, o in enumerate(outs) if k not in self.dirty)
            if not outs:
                return None
        return outs[0] if len(outs) == 1 else outs


class BackwardRunner(BackwardChecks):
    """Calls the user's backward with a BackwardContext.

    The real kernel of `_bwd` runs in C++ (Note [Python kernels]) and uses
    what bridge.BackwardRunnerProtocol names;
    ``__call__`` gives Python callers (fake kernels, graph passes, stored
    programs) the same C++ run.
    """

    def __init__(self, fn_name: str, backward: Callable, specs):
        self.fn_name = fn_name
        self.backward = backward
        self.specs = specs
        self.n_args = len(specs)
        self.tensor_flags = tuple(s.is_tensor for s in specs)
        self.arg_names = tuple(s.name for s in specs)

    def __call__(self, saved, grads, needs_input_grad, state, state_ints):
        """(gradients,): one gradient or None per forward argument; gradients
        that alias a saved tensor or an output gradient are copies."""
        return (
            _C.run_backward(
                self, self.backward, saved, grads, needs_input_grad, state, list(state_ints)
            ),
        )

    @staticmethod
    def decode_ctx(state: str, saved: tuple, state_ints) -> tuple:
        """(explicitly saved tensors, attributes) from `_bwd`'s state arguments."""
        n_explicit, attrs = decode_state(state, saved, state_ints)
        return tuple(saved[:n_explicit]), attrs


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def make_backward_fake(runner: BackwardRunner, fn_name: str) -> Callable:
    """The fake kernel of ``Name_bwd``: the user's backward on fake tensors.
    Its gradients have the forward inputs' shapes, so unbacked sizes made inside
    (snntorch's ``grad[input_ < 0] = 0``) are not left pending; a backward that
    branches on its data gets fakes from real runs (Note [Fake from a real run])."""

    funcs = side_effects.functions_of(runner.backward)

    def fake_backward(saved, grads, needs_input_grad, state, state_ints):
        # Note [Fake runs leave no trace] (side_effects.py)
        with side_effects.quiet(None, (), funcs):
            return _fake_backward(saved, grads, needs_input_grad, state, state_ints)

    def _fake_backward(saved, grads, needs_input_grad, state, state_ints):
        values = [list(saved), list(grads), list(state_ints)]
        try:
            # grad mode off, as eager autograd runs a backward (Note [Stored
            # programs run in eager's state] in archive/trace.py); the fake's
            # own ops are not recorded, only its gradients' shapes are used
            with dynamo_disabled(), torch.no_grad(), \
                    fake_from_real.discarding_fresh_unbacked(values, ignore=True):
                return list(runner(saved, grads, needs_input_grad, state, state_ints)[0])
        except Exception as e:
            why = ""
            if fake_from_real.is_data_dependent(e):
                try:
                    return _backward_from_real(runner, values, needs_input_grad, state)
                except fake_from_real.NotShapeFollowing as w:
                    why = f"; its gradient shapes could not be learnt from runs on stand-in data: {w}"
            raise RuntimeError(
                f"torch_opaque: {fn_name}.backward cannot run on fake tensors while tracing "
                f"a training graph ({type(e).__name__}: {e}{why}). Write the backward with "
                f"torch operations (no numpy, .item() or data-dependent Python), or trace "
                f"for inference only (torch.no_grad / torch.export)."
            ) from e

    return fake_backward


def _backward_from_real(runner: BackwardRunner, values, needs_input_grad, state) -> list:
    def run(saved, grads, state_ints):
        return list(runner(saved, grads, needs_input_grad, state, state_ints)[0]), [], None

    made, _, _ = fake_from_real.outputs_from_real(run, values)
    return list(made)
