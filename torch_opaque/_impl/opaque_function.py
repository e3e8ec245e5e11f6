"""The operator side of one autograd.Function subclass: how its calls are
bound, which overload each call uses, and how overloads are defined (from
hints, from a first call's values, or from an archive's claim)."""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
from torch.autograd.function import _is_setup_context_defined

from .._native import _C
from ..errors import ArchiveError, FakeForwardError
from . import extension_points as _ep
from . import in_place, side_effects
from .kernels import FakeRunner, Runner, check_tensor_outputs
from .overload import Overload
from .registry import _LOCK, _class_freed
from .schema import kinds_key, returns_from_hint, specs_from_hints, type_hints
from .schema import hints_accept, specs_for_call
from .tracing import one_plain_sample, real_shaped


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
        # seen to change besides its outputs, or None (read by integrations/dynamo.py).
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
        for check in _ep.before_call:  # DTensor without a rule: Note [Extension points]
            check(self, values)
        ov = self.defined_overload(values)
        primed = None
        if ov is None:
            tracer = _ep.traced_by(values)  # Note [FX symbolic tracing] (integrations/fx.py)
            if tracer is not None:
                return tracer.call(self, values)
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
