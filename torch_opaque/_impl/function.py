"""Turning a torch.autograd.Function subclass into an opaque operator.

Example::

    >>> import torch, torch_opaque
    >>> @torch_opaque.op(name="MySin")
    ... class MySin(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.sin()
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         (x,) = ctx.saved_tensors
    ...         return grad * x.cos()
    >>> x = torch.randn(3, requires_grad=True)
    >>> MySin.apply(x).sum().backward()        # runs torch.ops.opaque.MySin
    >>> bool(torch.allclose(x.grad, x.detach().cos()))
    True
"""

from __future__ import annotations

import hashlib
import inspect
import re
import sys
import threading
import weakref
from typing import Optional

import torch
from torch.autograd.function import _is_setup_context_defined

from .. import _C
from ..errors import ArchiveError, FakeForwardError, SchemaError
from ..hooks import apply as _apply_hook
from ..hooks import fx as _fx
from ..hooks import onnx_registry as _onnx_hook
from .kernels import BackwardRunner, FakeRunner, InferenceFake, Runner, check_tensor_outputs
from .kernels import make_backward_fake
from . import autocast_variant, batching, forward_ad, in_place, inductor_inline, sharding, side_effects
from .schema import kinds_key, returns_from_hint, specs_from_hints, type_hints
from .subclass_rules import SubclassRules
from .schema import hints_accept, schema_arguments, specs_for_call, specs_from_values
from .tracing import one_plain_sample, real_shaped

DEFAULT_NAMESPACE = "opaque"

# Note [Registry lifetime]
# The registry never holds a Function class strongly: OpaqueFunction keeps a
# weak reference to its class, and entries are keyed by id(cls). When a class
# is garbage collected (a factory that makes a class per call, then drops it),
# its entries go and its ops are released (_C.release_op drops the dispatcher
# registrations, the fake kernels and the torch.ops attributes), so a loop that
# creates and drops classes keeps memory bounded. An op that autograd nodes of
# live tensors still use is released later, at the next registry change.
# A class whose forward/backward refers to the class itself (a closure over it,
# super() in a subclass) is kept alive by its own kernels and never freed.
_LOCK = threading.RLock()  # held only while the registry changes, never while user code runs
_BY_ID: dict = {}  # id(class) -> OpaqueFunction
_BY_OPNAME: dict = {}  # (namespace, name) -> OpaqueFunction, until its ops are released
_PENDING_RELEASE: list = []  # OpaqueFunctions of dead classes whose ops are still in use


def function_for_op(namespace: str, name: str) -> Optional["OpaqueFunction"]:
    """The OpaqueFunction whose ops are ``namespace::name`` (and its _fwd / _bwd),
    if a Python Function defines them in this process (the registry's one reader
    outside this module)."""
    return _BY_OPNAME.get((namespace, name))

# Stock autograd.Function.apply (Note [Apply interception] in hooks/apply.py).
_ORIGINAL_APPLY = _apply_hook.ORIGINAL_APPLY


def _register_fake(lib, op, kernel, source: str) -> None:
    """``torch.library.register_fake(op, kernel, lib=lib)`` without its caller
    look-up: that one reads the caller's source file (inspect.getframeinfo) to
    name the registration, a third of the cost of wrapping a class
    (benchmarks/bench_registration.py). Same registry entry, same Meta kernel,
    same handle kept by ``lib`` (released with it)."""
    entry = torch._library.simple_registry.singleton.find(op._name)
    lib._registration_handles.append(entry.fake_impl.register(kernel, source, lib=lib))


def default_name(cls: type) -> str:
    """``<Qualname>_<6 hex digits of the module>``: stable across processes and
    distinct for equal class names in different modules."""
    qual = re.sub(r"\W", "_", cls.__qualname__.replace(".<locals>.", "_").replace(".", "_"))
    digest = hashlib.sha1(cls.__module__.encode()).hexdigest()[:6]
    return f"{qual}_{digest}"


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
        SubclassRules(self).register(self, fn.lib)  # Note [Ops on wrapper subclasses]
        sharding.install_for_overload(self)  # Note [Sharding opaque ops]
        _onnx_hook.new_ops((self.op, self.fwd_op, self.bwd_op))  # Note [torch.onnx.export of opaque ops]
        autocast_variant.register(self, fn.lib)  # Note [Autocast in the call]
        inductor_inline.add(self)  # Note [Inductor sees through opaque ops]
        self._own_references = self._references()  # Note [Ops that graphs hold]

    def _references(self) -> tuple:
        """How many references the op family's OpOverload objects and packets
        have (those in Inductor's tables not counted)."""
        ops = [o for o in (self.op, self.fwd_op, self.bwd_op, self.jvp_op) if o is not None]
        return tuple(sys.getrefcount(o) - inductor_inline.table_references(o) for o in ops) + tuple(
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


class OpaqueFunction:
    """The operator side of one autograd.Function subclass."""

    def __init__(self, cls: type, namespace: str, name: str, explicit: bool = True):
        self.cls_ref = weakref.ref(cls, _class_freed(id(cls)))
        self.namespace = namespace
        self.name = name
        self.display_name = cls.__qualname__
        self.explicit = explicit  # False while only auto mode routes calls to the op
        self.auto_checked: set = set()  # overload names auto() saw run (Note [Auto fall-back])
        self.setup_style = _is_setup_context_defined(cls.setup_context)
        params = list(inspect.signature(cls.forward).parameters.values())
        if not self.setup_style:
            if not params:
                raise TypeError(f"torch_opaque: {self.display_name}.forward must take ctx.")
            params = params[1:]
        self.varargs = False
        names, defaults = [], {}
        for p in params:
            if p.kind is p.VAR_POSITIONAL:
                self.varargs = True
                break
            if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD):
                raise TypeError(
                    f"torch_opaque: {self.display_name}.forward has keyword-only argument "
                    f"'{p.name}'; autograd.Function.apply passes arguments by position. "
                    f"Make it a positional argument."
                )
            names.append(p.name)
            if p.default is not p.empty:
                defaults[p.name] = p.default
        self.arg_names = names
        self.defaults = defaults
        self.signature = inspect.Signature(params)
        self.lib = torch.library.Library(namespace, "FRAGMENT")
        hints = type_hints(cls.forward)
        self.hint_specs = (
            None
            if self.varargs or hints is None
            else specs_from_hints(cls.forward, names, defaults, self.display_name, hints)
        )
        # (number of outputs, returns a tuple) from forward's return hint, or None.
        self.returns_hint = None if hints is None else returns_from_hint(cls.forward, hints)
        self.overloads: dict = {}  # overload name -> Overload
        self._by_kinds: dict = {}  # kinds_key -> Overload
        self._single: Optional[Overload] = None  # set when the schema comes from hints
        # Note [Direct apply] (csrc/python/direct_apply.h): the argument-type
        # signatures the C-level Cls.apply already routes to an overload.
        self.direct_keys: set = set()
        # Note [In-place Functions] (in_place.py)
        self.dirty = in_place.uses_mark_dirty(cls)
        self.dirty_pairs = None  # ((output index, argument index), ...) once known
        # Note [Forward side effects] (side_effects.py): what the forward was
        # seen to change besides its outputs, or None (read by hooks/dynamo.py).
        self.side_effects: Optional[str] = None

    def wrap_forward(self, forward):
        """``forward`` (or the user's ``fake``) as the op's kernels run it:
        on copies of the arguments for in-place Functions (Note [In-place
        Functions])."""
        if forward is None or not self.dirty:
            return forward
        if self.setup_style:
            return in_place.dirty_setup_forward(forward)
        return in_place.dirty_forward(self, forward)

    @property
    def forward(self):
        """The forward the op's kernels run (Note [In-place Functions])."""
        return self.wrap_forward(self.cls.forward)

    @property
    def setup(self):
        """The setup_context the op's kernels run, or None."""
        if not self.setup_style:
            return None
        setup = self.cls.setup_context
        return in_place.dirty_setup(self, setup) if self.dirty else setup

    @property
    def cls(self) -> type:
        cls = self.cls_ref()
        if cls is None:
            raise RuntimeError(
                f"torch_opaque: the class of {self.namespace}::{self.name} was garbage collected."
            )
        return cls

    @property
    def direct_apply(self):
        """The C-level ``Cls.apply`` (Note [Direct apply]), or None."""
        cls = self.cls_ref()
        attr = cls.__dict__.get("apply") if cls is not None else None
        d = getattr(attr, "__func__", None)
        return d if isinstance(d, _C.DirectApply) else None

    def __repr__(self):
        return f"<torch_opaque op {self.namespace}::{self.name} for {self.display_name}>"

    # ---- calling ------------------------------------------------------------------

    def bind(self, args: tuple, kwargs: dict) -> list:
        """Positional arguments with defaults filled in, in forward's order."""
        if self.varargs:
            if kwargs:
                raise TypeError(f"torch_opaque: {self.display_name}.apply takes no keyword arguments")
            return list(args)
        if not kwargs and len(args) == len(self.arg_names):
            return list(args)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return [bound.arguments[n] for n in self.arg_names]

    def apply(self, *args, **kwargs):
        values = self.bind(args, kwargs)
        if sharding.has_dtensor(values) and not sharding.has_rule(self.cls):
            raise sharding.missing_rule_error(self.display_name)  # Note [Sharding opaque ops]
        ov = self.defined_overload(values)
        primed = None
        if ov is None:
            if _fx.traced_by_fx(values):  # Note [FX symbolic tracing] (hooks/fx.py)
                return _fx.call(self, values)
            ov, primed = self.first_call(values)
        if self.dirty:  # the results hold the arguments: no C-level apply
            return ov.call_primed(values, *primed) if primed is not None else ov(values)
        if self.explicit and not kwargs and len(args) == len(values):
            key = tuple(map(type, args))
            if key not in self.direct_keys and list not in key and tuple not in key:
                direct = self.direct_apply
                if direct is not None:
                    self.direct_keys.add(key)
                    direct.add(key, *ov.direct_entry())
        if primed is not None:
            return ov.call_primed(values, *primed)
        return ov(values)

    def defined_overload(self, values: list) -> Optional[Overload]:
        """The overload already defined for these values' kinds, or None (then
        first_call defines it)."""
        ov = self._single  # Note [Hints are advice]: only for values the hints carry
        if ov is not None and hints_accept(self.hint_specs, values):
            return ov
        return self._by_kinds.get(kinds_key(values))

    # ---- defining overloads ----------------------------------------------------------

    def overload_for(self, values: list, outputs=None) -> Overload:
        """The overload for these argument values, defining it on first use.
        `outputs`: what forward returned for them, if it already ran (else the
        number of outputs comes from the return hint or a fake run).

        The output probe runs the user's forward, so it runs without the
        registry lock (a forward may call wrapped Functions from other
        threads); only the registration itself is under the lock."""
        key = kinds_key(values)
        ov = self._by_kinds.get(key)
        if ov is not None:
            return ov
        names = [f"arg{i}" for i in range(len(values))] if self.varargs else self.arg_names
        specs, overload = specs_for_call(  # Note [Hints are advice]
            self.hint_specs, names, values, self.defaults, self.display_name
        )
        ov = self.overloads.get(overload or "default")
        if ov is None:
            if self.dirty and self.dirty_pairs is None:  # learnt from a (fake) run
                self._probe(specs, values)
            if outputs is not None:
                n_out, returns_tuple = _output_structure(self.display_name, outputs)
            else:
                n_out, returns_tuple = self.returns_hint or self._probe(
                    specs, values
                )
            ov = self.define_overload(overload, specs, n_out, returns_tuple, values)
            if ov.claimed_by is None:
                return ov
        if ov.claimed_by is not None:  # defined by torch_opaque.load (Note [Archive claims])
            self._confirm(ov, specs, values, outputs)
        with _LOCK:
            self._by_kinds[key] = ov
            if self.hint_specs is not None and not overload:
                self._single = ov
        return ov

    def define_overload(self, overload: str, specs, n_out: int, returns_tuple: bool,
                        values=None, *, dirty=None, claimed_by: Optional[str] = None) -> Overload:
        """The overload ``overload`` ("" for the default), registered with these
        specs and outputs unless it exists (another thread may have won); calls
        whose arguments are of the kinds of ``values`` use it from now on (with a
        schema from hints: every call). The one writer of the overload tables:
        first calls, decoration (Note [Registered at decoration]) and archives.

        ``claimed_by``: the archive whose manifest gave ``n_out``,
        ``returns_tuple`` and ``dirty`` (the output pairs of an in-place
        Function); no call uses that overload before the Function's own run
        confirms them (Note [Archive claims]), so ``values`` is ignored then."""
        with _LOCK:
            ov = self.overloads.get(overload or "default")
            if ov is None:
                ov = Overload(self, overload, specs, n_out, returns_tuple, dirty, claimed_by)
                self.overloads[ov.name] = ov
                if claimed_by is not None:
                    return ov
                if self.hint_specs is not None and not overload:
                    self._single = ov
            elif ov.claimed_by is not None:
                return ov
            if values is not None:
                self._by_kinds[kinds_key(values)] = ov
        return ov

    def _confirm(self, ov: Overload, specs, values, outputs) -> None:
        """Note [Archive claims]: a Function the process owns is the authority on
        its own outputs. ``torch_opaque.load`` defines an overload of it from an
        archive's manifest without running it (the loaded program needs the op
        before any call), but the manifest's n_out, returns_tuple and in-place
        pairs are only a claim: the first call of that overload learns the real
        ones as a call without the archive would (the real forward's result of
        an eager first call, the return annotation, or a fake run when traced),
        and only then do calls use the overload. A different returns_tuple is
        corrected (``Cls.apply`` returns what stock returns; a warning names the
        archive); a different number of outputs or in-place pairs is part of the
        op's schema, which cannot change once defined: ArchiveError naming the
        op, the class, the archive and the field. The loader refuses what it
        can tell at load time, before it defines anything: other arguments, a
        claim against the return annotation, against an overload the process
        already has, or against in-place pairs already learnt
        (archive/loading.py, _check_claims)."""
        if outputs is not None:
            n_out, returns_tuple = _output_structure(self.display_name, outputs)
        elif self.returns_hint is not None and not (self.dirty and self.dirty_pairs is None):
            n_out, returns_tuple = self.returns_hint
        else:
            n_out, returns_tuple = self._probe(specs, values)  # learns dirty_pairs too
        pairs = tuple(self.dirty_pairs or ()) if self.dirty else ()
        with _LOCK:
            archive = ov.claimed_by
            if archive is None:  # another thread confirmed it
                return
            cls = self.cls
            where = f"{self.namespace}::{self.name}.{ov.name}"
            who = f"{cls.__module__}.{cls.__qualname__}"
            if n_out != ov.n_out or pairs != ov.dirty:
                field, claimed, actual = (
                    ("n_out", ov.n_out, n_out)
                    if n_out != ov.n_out
                    else ("dirty", [list(p) for p in ov.dirty], [list(p) for p in pairs])
                )
                raise ArchiveError(
                    f"torch_opaque: {who}.forward gives {field}={actual} for {where}, but "
                    f"that op was defined by torch_opaque.load of {archive}, whose manifest "
                    f"says {field}={claimed}: the archive was not written by torch_opaque.save "
                    f"for this Function (the Function changed since, or the file was edited). "
                    f"An op cannot be redefined in a process: in a fresh process, load an "
                    f"archive saved from this Function (or save the program again)."
                )
            warning = None
            if returns_tuple != ov.returns_tuple:

                def what(t):
                    return "a tuple" if t else "a Tensor"

                warning = (
                    f"torch_opaque: {archive} (loaded by torch_opaque.load) says {where} "
                    f"returns {what(ov.returns_tuple)} (returns_tuple="
                    f"{str(ov.returns_tuple).lower()}), but {who}.forward returns "
                    f"{what(returns_tuple)}; {cls.__qualname__}.apply returns what the "
                    f"Function returns. The archive was not written by torch_opaque.save for "
                    f"this Function: load one that was."
                )
                ov.returns_tuple = returns_tuple
            ov.claimed_by = None
        if warning is not None:
            import warnings

            warnings.warn(warning, stacklevel=2)

    def define_from_hints(self) -> Optional[Overload]:
        """Note [Registered at decoration]: a Function whose forward arguments
        and return are all annotated has one schema, known without a call, so
        its op is defined when the class is wrapped. Importing the module that
        defines it then registers the op, and ``torch.export.load`` of a program
        calling it works in a fresh process. Others are defined by their first
        call of each kind of arguments (None here)."""
        if self.hint_specs is None or self.dirty:  # dirty outputs are known from a run
            return None
        returns = self.returns_hint
        if returns is None:
            return None
        return self.define_overload("", self.hint_specs, *returns)

    def first_call(self, values: list) -> tuple:
        """(overload, primed result or None) for a call whose kinds of arguments
        have no overload yet.

        Note [First call runs forward once]: an eager call (``Cls.apply`` of a
        wrapped class, or any Function's inside ``auto()``) learns the outputs
        from the user's forward run for real (as the op's kernel would run it:
        grad mode off, the same needs_input_grad), then hands that result to
        the kernel, so the forward runs once, as with stock autograd.Function
        (same RNG draws, same side effects). Traced calls (fake tensors,
        dispatch modes) and forwards with a return hint do not run it here.
        """
        if self.returns_hint is not None or _traced(values):
            return self.overload_for(values), None
        needs = tuple(
            torch.is_grad_enabled() and isinstance(v, torch.Tensor) and v.requires_grad
            for v in values
        )
        if not any(needs):
            needs = (False,) * len(values)
        names = [f"arg{i}" for i in range(len(values))] if self.varargs else self.arg_names
        # schema errors before the forward runs (Note [Hints are advice])
        specs_for_call(self.hint_specs, names, values, self.defaults, self.display_name)
        runner = Runner(self.display_name, self.forward, self.setup, [], -1, arg_names=names)
        watch = side_effects.Watch(self, values)  # Note [Forward side effects]
        out, ctx = runner.run_first(needs, values)
        effect = watch.found(out)
        if effect:
            self.side_effects = self.side_effects or effect
            if watch.lost_in_eager:
                side_effects.lost_in_eager(self, effect)
        return self.overload_for(values, outputs=out), (out, ctx)

    def _probe(self, specs, values) -> tuple:
        """(number of outputs, returns a tuple) by running forward on fake tensors."""
        from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
        from torch.utils._python_dispatch import _disable_current_modes

        user_fake = getattr(self.cls, "fake", None)
        setup = self.setup
        runner = FakeRunner(
            self.display_name,
            self.wrap_forward(user_fake) or self.forward,
            setup,
            specs,
            n_out=-1,
            has_user_fake=user_fake is not None,
        )
        tracing = any(
            is_fake(v) for v in _flat_tensors(values)
        ) or torch._guards.detect_fake_mode() is not None

        # no torch-function mode either: export's would record the forward's
        # grad-mode changes as empty regions of the program being traced
        with _disable_current_modes(), torch._C.DisableTorchFunction(), \
                FakeTensorMode(allow_non_fake_inputs=True):

            from .context import ForwardContext

            try:
                out = runner.call_user(
                    ForwardContext(self.display_name, (False,) * len(values)),
                    [real_shaped(v) for v in values],
                )
            except FakeForwardError:
                if tracing:
                    raise
                out = None
        if out is None:
            # Eager use of a forward that cannot run on fake tensors: learn the
            # output structure from one real call (without autograd).
            from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

            plain = [one_plain_sample(v) for v in values]
            with torch.no_grad(), temporarily_clear_interpreter_stack(), side_effects.quiet(self, values):
                out = Runner(self.display_name, self.forward, setup, specs, -1).call_user(
                    ForwardContext(self.display_name, (False,) * len(values)), plain
                )
        return _output_structure(self.display_name, out)


def _output_structure(fn_name: str, out) -> tuple:
    """(number of outputs, returns a tuple) of what a forward returned."""
    outs = out if isinstance(out, tuple) else (out,)
    check_tensor_outputs(fn_name, outs)
    return len(outs), isinstance(out, tuple)


def _traced(values) -> bool:
    """Whether a call is being traced or transformed rather than run: fake or
    subclass tensor arguments, an active fake / dispatch mode, or torch.func."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    for v in _flat_tensors(values):
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            return True
    if _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled():
        return True
    if torch._C._functorch.maybe_current_level() is not None:  # torch.func transforms
        return True
    return torch._guards.detect_fake_mode() is not None


def _flat_tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


# ---- public entry points ------------------------------------------------------------


def route_apply(cls, *args, **kwargs):
    """Every ``Function.apply`` call once routing is installed (Note [Apply
    interception] in hooks/apply.py), and the fallback of the C-level
    ``Cls.apply`` of wrapped classes: the op of a wrapped class, auto mode's
    choice inside ``auto()``, else the stock Function."""
    fn = _BY_ID.get(id(cls))
    if fn is not None and fn.explicit and fn.cls_ref() is cls:
        return fn.apply(*args, **kwargs)
    if _auto.active():
        return _auto.call(cls, args, kwargs)
    return _ORIGINAL_APPLY(cls, *args, **kwargs)


route_apply.__name__ = "apply"
_ROUTING = False


def ensure_routing() -> None:
    """Install the apply interception and the (lazy) Dynamo hook, once."""
    global _ROUTING
    if _ROUTING:
        return
    from ..hooks import dynamo as _dynamo_hook
    from ..hooks import torchscript as _torchscript_hook

    _apply_hook.install_apply_route(route_apply, _BY_ID, _auto._state)
    _dynamo_hook.install_when_dynamo_loads()
    _torchscript_hook.install()  # Note [TorchScript and wrapped classes]
    _onnx_hook.install_when_onnx_loads()  # Note [torch.onnx.export of opaque ops]
    _ROUTING = True


def _guard_backward(backward, cls_ref):
    """An auto-registered class's backward: a failure there falls back
    (Note [Auto fall-back])."""

    def guarded(ctx, *grads):
        try:
            return backward(ctx, *grads)
        except Exception as e:
            fn = _BY_ID.get(id(cls_ref()))
            if fn is None or not fn.explicit:
                _auto.backward_failed(cls_ref(), e)
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


def _make_apply(cls: type, fn: OpaqueFunction):
    """``cls.apply``: a C-level DirectApply with ``route_apply`` as its fallback."""
    apply = _C.DirectApply(cls, route_apply)
    apply.__name__ = "apply"
    apply.__qualname__ = f"{cls.__qualname__}.apply"
    apply.__doc__ = f"Runs the op {fn.namespace}::{fn.name} (torch_opaque); {cls.__qualname__} is unchanged."
    apply.__signature__ = inspect.signature(_ORIGINAL_APPLY)  # (cls, *args, **kwargs)
    return apply


# ---- lifetime (Note [Registry lifetime]) ----------------------------------------------


def _class_freed(key: int):
    def freed(_ref):
        if sys is None or sys.is_finalizing():
            return
        try:
            with _LOCK:
                fn = _BY_ID.pop(key, None)
                if fn is not None:
                    _PENDING_RELEASE.append(fn)
                _release_pending()
        except Exception as e:  # never raise from a weakref callback
            import warnings

            warnings.warn(f"torch_opaque: could not release the ops of a freed class: {e}")

    return freed


# Note [Ops that graphs hold]
# A graph that calls an op (an ExportedProgram, a GraphModule from FX or
# torch.export, a compiled graph, Dynamo's and FakeTensorMode's caches)
# holds its OpOverload objects, which point at the dispatcher's registration:
# deregistering the op when its class dies would leave them dangling (calls
# fail with nonsense or crash). So the ops of a dead class are released only
# while nothing but torch_opaque holds those objects (reference counts at
# most what they were when the overload was defined) and no autograd node
# uses them; otherwise they stay registered, pending, for the process (a
# class traced once keeps its ops: memory, never a dangling op).


def _release_pending() -> None:
    """Release the ops of dead classes that nothing uses any more (under _LOCK)."""
    pending = _PENDING_RELEASE[:]  # a collection during this loop may add more
    del _PENDING_RELEASE[:]
    for fn in pending:
        if any(ov.held_elsewhere() for ov in fn.overloads.values()):
            _PENDING_RELEASE.append(fn)  # Note [Ops that graphs hold]
            continue
        if all(_C.release_op(ov.handle, 1) for ov in fn.overloads.values()):
            _forget(fn)
        else:
            _PENDING_RELEASE.append(fn)


def _forget(fn: OpaqueFunction) -> None:
    if _BY_OPNAME.get((fn.namespace, fn.name)) is fn:
        del _BY_OPNAME[(fn.namespace, fn.name)]
    for ov in fn.overloads.values():
        sharding.forget(ov)
    fn.lib._destroy()
    from torch._library import simple_registry

    for ov in fn.overloads.values():  # the (now empty) fake-kernel entries
        inductor_inline.remove(ov)
        for suffix in ("", "_fwd", "_bwd", "_jvp"):
            base = f"{fn.namespace}::{fn.name}{suffix}"
            simple_registry.singleton._data.pop(f"{base}.{ov.name}", None)
            simple_registry.singleton._data.pop(base if not ov.overload else f"{base}.{ov.overload}", None)
    ns = getattr(torch.ops, fn.namespace)
    for suffix in ("", "_fwd", "_bwd", "_jvp"):  # torch.ops' caches of the deregistered ops
        vars(ns).pop(fn.name + suffix, None)
        if fn.name + suffix in ns._dir:
            ns._dir.remove(fn.name + suffix)
    fn.overloads.clear()
    fn._by_kinds.clear()
    fn._single = None


def define_autocast_variant(fn: OpaqueFunction, variant_cls: type, name: str) -> OpaqueFunction:
    """The op family of ``fn``'s autocast variant (Note [Autocast in the call]):
    ``variant_cls`` wrapped as ``name`` (or a free name after it), its class
    kept alive by the variant, which ``fn`` keeps."""
    with _LOCK:
        op_name = _free_name(fn.namespace, name)
        variant = OpaqueFunction(variant_cls, fn.namespace, op_name, explicit=True)
        variant.autocast_base = fn
        # its forward wraps the user's, which marks the arguments dirty
        variant.dirty, variant.dirty_pairs = fn.dirty, fn.dirty_pairs
        variant.autocast_class = variant_cls
        _BY_ID[id(variant_cls)] = variant
        _BY_OPNAME[(fn.namespace, op_name)] = variant
    return variant


def _free_name(namespace: str, base: str) -> str:
    """``base``, or ``base_2``, ``base_3``... when a live class holds it (a factory
    making one class per call: each gets its own op)."""
    name, k = base, 1
    while (namespace, name) in _BY_OPNAME:
        k += 1
        name = f"{base}_{k}"
    return name


def _check_wrappable(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(
            f"torch_opaque: expected a torch.autograd.Function subclass, got {cls!r}. "
            f"Decorate the class itself (not an instance or its apply)."
        )
    if cls.backward is torch.autograd.Function.backward:
        raise TypeError(
            f"torch_opaque: {cls.__qualname__} defines no backward; an opaque op needs one. "
            f"Add a backward staticmethod."
        )


def wrap(
    cls: type,
    *,
    name: Optional[str] = None,
    namespace: str = DEFAULT_NAMESPACE,
    _patch_apply: bool = True,
) -> type:
    """Make ``cls.apply`` call a registered operator; the class body is unchanged.

    For classes you cannot edit (they live in another package)::

        torch_opaque.wrap(their_module.TheirFunction)

    Wrapping twice is harmless; asking for a different name the second time is an
    error. Returns ``cls``.
    """
    _check_wrappable(cls)
    ensure_routing()
    with _LOCK:
        existing = lookup(cls)
        if existing is not None:
            if (name and name != existing.name) or namespace != existing.namespace:
                raise ValueError(
                    f"torch_opaque: {cls.__qualname__} is already wrapped as "
                    f"{existing.namespace}::{existing.name}; it cannot also be "
                    f"{namespace}::{name or default_name(cls)}. Wrap it once."
                )
            if _patch_apply and not existing.explicit:
                existing.explicit = True
                cls.apply = classmethod(_make_apply(cls, existing))
            return cls
        if _PENDING_RELEASE:
            _release_pending()
        if name:
            op_name = name
            other = _BY_OPNAME.get((namespace, op_name))
            if other is not None:
                o = other.cls_ref()
                where = f"{o.__module__}.{o.__qualname__}" if o is not None else "a freed class"
                raise ValueError(
                    f"torch_opaque: op name {namespace}::{op_name} is already used by "
                    f"{where}; pass a different name= for {cls.__module__}.{cls.__qualname__}."
                )
        else:
            op_name = _free_name(namespace, default_name(cls))
        fn = OpaqueFunction(cls, namespace, op_name, explicit=_patch_apply)
        _BY_ID[id(cls)] = fn
        _BY_OPNAME[(namespace, op_name)] = fn
        if _patch_apply:
            cls.apply = classmethod(_make_apply(cls, fn))
    if _patch_apply:
        fn.define_from_hints()
    return cls


def op(cls: Optional[type] = None, *, name: Optional[str] = None, namespace: str = DEFAULT_NAMESPACE):
    """Class decorator: ``@torch_opaque.op`` or ``@torch_opaque.op(name=..., namespace=...)``.

    Afterwards ``Cls.apply(...)`` (and every alias of it) runs
    ``torch.ops.<namespace>.<name>``, and every export path keeps the call as
    one node; the class body is unchanged. Same as :func:`wrap`.

    * Name: ``name`` or ``<Qualname>_<6 hex digits of the module name>``
      (stable across processes); namespace ``"opaque"`` by default.
    * Schema: from the type hints when every forward argument is annotated
      (one overload, registered right away when the return is annotated too);
      otherwise from the kinds of each call's arguments (``Name.Tensor_float``...).
    * Tracing runs the forward on fake tensors; a forward that cannot (numpy,
      ``.item()``) gets a ``fake`` staticmethod with forward's signature that
      returns outputs of the right shape and saves the same tensors.

    Example::

        >>> import torch, torch_opaque
        >>> @torch_opaque.op(name="DocOpScale")
        ... class Scale(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ...         ctx.k = k
        ...         return x * k
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return g * ctx.k, None
        >>> print(torch.ops.opaque.DocOpScale.default._schema)
        opaque::DocOpScale(Tensor x, float k) -> Tensor
        >>> x = torch.ones(2, requires_grad=True)
        >>> Scale.apply(x, 3.0).sum().backward()
        >>> x.grad
        tensor([3., 3.])
    """
    if cls is None:
        return lambda c: wrap(c, name=name, namespace=namespace)
    return wrap(cls, name=name, namespace=namespace)


def lookup(cls: type) -> Optional[OpaqueFunction]:
    """The OpaqueFunction of a class wrapped explicitly or met in auto mode, or None."""
    fn = _BY_ID.get(id(cls))
    return fn if fn is not None and fn.cls_ref() is cls else None


def is_wrapped(cls: type) -> bool:
    """Whether ``cls.apply`` always runs its op (torch_opaque.op / wrap)."""
    fn = lookup(cls)
    return fn is not None and fn.explicit


from ..hooks import auto as _auto  # noqa: E402  (auto mode calls back into this module)
