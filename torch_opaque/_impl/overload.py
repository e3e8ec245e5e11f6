"""One registered schema of a wrapped Function: its ops (``Name``, ``Name_fwd``,
``Name_bwd``, ``Name_jvp``), their kernels and fakes, defined with the
dispatcher."""

from __future__ import annotations

import sys
from typing import Optional

import torch

from .._native import _C
from ..errors import SchemaError
from . import auto_state, batching, forward_ad, in_place
from . import extension_points as _ep
from .kernels import BackwardRunner, FakeRunner, InferenceFake, Runner, make_backward_fake
from .registry import _BY_ID
from .schema import schema_arguments


def _register_fake(lib, op, kernel, source: str) -> None:
    """``torch.library.register_fake(op, kernel, lib=lib)`` without its caller
    look-up: that one reads the caller's source file (inspect.getframeinfo) to
    name the registration, a third of the cost of wrapping a class
    (benchmarks/bench_registration.py). Same registry entry, same Meta kernel,
    same handle kept by ``lib`` (released with it)."""
    entry = torch._library.simple_registry.singleton.find(op._name)
    lib._registration_handles.append(entry.fake_impl.register(kernel, source, lib=lib))



class Overload:
    """One registered schema of a wrapped Function."""

    def __init__(self, fn: "OpaqueFunction", overload: str, specs, n_out, returns_tuple,
                 dirty=None, claimed_by: Optional[str] = None):
        self.specs = specs
        self.n_out = n_out
        self.returns_tuple = returns_tuple
        # Note [Archive claims]: the archive whose manifest gave n_out,
        # returns_tuple and dirty, until the Function's own run confirms them.
        self.claimed_by = claimed_by
        self.fn = fn
        self.overload = overload
        self.name = overload or "default"
        name = fn.display_name
        forward = fn.forward
        setup = fn.setup
        user_fake = fn.wrap_forward(getattr(fn.cls, "fake", None))
        self.runner = Runner(name, forward, setup, specs, n_out)
        fake_runner = FakeRunner(
            name, user_fake or forward, setup, specs, n_out, has_user_fake=user_fake is not None
        )
        self.fake_runner = fake_runner
        backward = fn.cls.backward
        if not fn.explicit:  # registered by auto(): Note [Auto fall-back]
            backward = _guard_backward(backward, fn.cls_ref)
            for r in (self.runner, fake_runner):
                r.encode_ctx = _exact_encoder(r)
        bwd = BackwardRunner(name, backward, specs)
        arguments = schema_arguments(specs)
        # Note [In-place Functions] (in_place.py): ((output, argument), ...)
        if not fn.dirty:
            self.dirty = ()
        elif dirty is None:
            self.dirty = in_place.dirty_pairs(fn, specs)
        else:  # an archive's claim (checked against specs by the loader)
            self.dirty = tuple((int(k), int(i)) for k, i in dirty)
        try:
            self.handle = _C.define_op(
                fn.namespace, fn.name, overload, arguments, ["Tensor"] * n_out, self.runner, bwd,
                self.dirty,
            )
        except RuntimeError as e:
            if "cannot define" not in str(e):
                raise
            raise SchemaError(
                f"torch_opaque: {name}: the schema inferred for its forward ({arguments}) "
                f"is not one torch accepts ({e}). Change the forward's arguments or their "
                f"defaults, or keep this Function unwrapped."
            ) from e
        ns = getattr(torch.ops, fn.namespace)
        self.op = getattr(getattr(ns, fn.name), self.name)
        _direct_op_call(self.op, f"{fn.namespace}::{fn.name}", overload)
        self.fwd_op = getattr(getattr(ns, fn.name + "_fwd"), self.name)
        self.bwd_op = getattr(getattr(ns, fn.name + "_bwd"), self.name)
        source = f"torch_opaque wrap of {name}"
        _register_fake(fn.lib, self.op, InferenceFake(fake_runner, self.dirty), source)
        _register_fake(fn.lib, self.fwd_op, fake_runner, source)
        _register_fake(fn.lib, self.bwd_op, make_backward_fake(bwd, name), source)
        self.bwd_runner = bwd
        self.jvp_op = None
        if forward_ad.has_jvp(fn.cls):
            forward_ad.define(self, fn.cls, fn.lib, arguments)
        batching.Rules(self, fn.cls).register(fn.lib, fn.name)
        # wrapper subclasses, sharding, ONNX, autocast, Inductor: Note [Extension points]
        _ep.fire(_ep.overload_defined, self)
        self._own_references = self._references()  # Note [Ops that graphs hold]

    def _references(self) -> tuple:
        """How many references the op family's OpOverload objects and packets
        have (those in integrations' tables, such as Inductor's, not counted)."""
        ops = [o for o in (self.op, self.fwd_op, self.bwd_op, self.jvp_op) if o is not None]
        return tuple(sys.getrefcount(o) - _ep.references_held(o) for o in ops) + tuple(
            sys.getrefcount(o.overloadpacket) for o in ops
        )

    def held_elsewhere(self) -> bool:
        """Whether something besides torch_opaque holds one of the op family's
        OpOverload objects (Note [Ops that graphs hold])."""
        return any(now > own for now, own in zip(self._references(), self._own_references))

    def __call__(self, args):
        out = self.op(*args)
        if self.dirty:
            return in_place.results(self, args, out)
        if self.returns_tuple and self.n_out == 1:
            return (out,)
        return out

    def call_primed(self, args, out, ctx):
        """This call, with the forward's result already known (Note [First call
        runs forward once])."""
        _C.set_primed(self.runner, out, ctx)
        try:
            return self(args)
        finally:
            _C.set_primed(None, None, None)

    def direct_entry(self) -> tuple:
        """(qualified name, overload, wrap_single): how DirectApply calls this
        overload (Note [Direct apply] in csrc/python/direct_apply.h)."""
        return (
            f"{self.fn.namespace}::{self.fn.name}",
            self.overload,
            self.returns_tuple and self.n_out == 1,
        )


def _direct_op_call(op, qualified_name: str, overload: str) -> None:
    """Replaces torch's ``op._op`` by the C-level OpCall (Note [Direct op call]
    in csrc/python/op_call.h): ``torch.ops`` calls of this overload skip the
    generic JIT argument parsing."""
    if not isinstance(op._op, _C.OpCall):
        op._op = _C.OpCall(op._op, qualified_name, overload)


def _guard_backward(backward, cls_ref):
    """An auto-registered class's backward: a failure there falls back
    (Note [Auto fall-back])."""

    def guarded(ctx, *grads):
        try:
            return backward(ctx, *grads)
        except Exception as e:
            fn = _BY_ID.get(id(cls_ref()))
            if fn is None or not fn.explicit:
                auto_state.backward_failed(cls_ref(), e)
            raise

    guarded.__name__ = getattr(backward, "__name__", "backward")
    guarded.__qualname__ = getattr(backward, "__qualname__", "backward")
    return guarded


def _exact_encoder(runner):
    """An auto-registered class's ctx encoder that refuses, in the forward (where
    auto() can still fall back), state the backward would not get back exactly:
    a value that does not decode, or decodes to another type (a namedtuple, an
    IntEnum, a numpy scalar, a float subclass) (Note [Auto fall-back])."""
    from .context import decode_state
    from ..errors import UnsupportedError

    encode = runner.encode_ctx

    def encode_ctx(ctx):
        state, ints, saved = encode(ctx)
        if state:
            try:
                _, attrs = decode_state(state, saved, ints)
            except Exception as e:
                raise UnsupportedError(
                    f"torch_opaque: {runner.fn_name}: ctx state cannot be passed to the "
                    f"backward op ({e})"
                ) from e
            for k, v in ctx.__dict__.items():
                if type(attrs.get(k)) is not type(v):
                    raise UnsupportedError(
                        f"torch_opaque: {runner.fn_name}: ctx.{k} (a {type(v).__name__}) would reach the "
                        f"backward as a {type(attrs.get(k)).__name__}"
                    )
        return state, ints, saved

    return encode_ctx

