"""Routing Dynamo's handling of ``Cls.apply`` to the op of a wrapped class.

Note [Dynamo and wrapped classes]
Dynamo does not call ``Cls.apply`` for a torch.autograd.Function subclass: it
recognises the class (and aliases ``f = Cls.apply``, by comparing ``f`` with
``Cls.apply``) and speculates forward/backward into its own higher-order op
(torch/_dynamo/variables/misc.py, AutogradFunctionVariable.call_apply).
For wrapped classes (and, inside ``torch_opaque.auto()``, every eligible
class) we replace that step: the argument trackers' example values pick the
overload (defining it if needed, outside the traced program), and the call is
emitted as a call of that OpOverload, so the graph holds one op node.

An alias bound before ``wrap`` is a bound method of the rerouted
``Function.apply`` (Note [Apply interception]) while ``Cls.apply`` is now
the C-level DirectApply, so Dynamo's alias comparison fails and it would
inline the trampoline. ``UserMethodVariable.call_function`` is therefore
patched too: a call of that function bound to a Function class goes to the
class's ``call_apply`` like any other apply call.

Installation is lazy: ``import torch_opaque`` does not import torch._dynamo
(about a second and 70 MiB). ``install_when_dynamo_loads`` patches at once
if Dynamo is already loaded, else adds a ``sys.meta_path`` finder that
patches right after ``torch._dynamo`` finishes importing.

Under torch.compile (not strict export) a Function whose forward has side
effects is not emitted as the op inside auto(), which falls back; an
explicitly wrapped class is emitted when the effect is on state outside the
call (a global, a closure variable, a class: the op stays opaque at run time
and applies it once per call) and refused when it is on an argument or an
output (Note [Forward side effects] in _impl/side_effects.py).
"""

from __future__ import annotations

import sys
import warnings

import torch

from .._impl import extension_points as _ep
from .._impl.extension_points import AfterFirstImport

_installed = False


def _example(vt):
    from torch._dynamo.variables import SymNodeVariable
    from torch._dynamo.variables.lists import BaseListVariable, SizeVariable, TupleVariable

    if vt.is_tensor():
        return vt.as_proxy().node.meta["example_value"]
    if isinstance(vt, SymNodeVariable):
        return vt.sym_num
    if isinstance(vt, SizeVariable):
        return torch.Size(_example(x) for x in vt.items)
    if isinstance(vt, BaseListVariable):
        items = [_example(x) for x in vt.items]
        return tuple(items) if isinstance(vt, TupleVariable) else items
    if vt.is_python_constant():
        return vt.as_python_constant()
    from ..errors import SchemaError

    raise SchemaError(
        f"torch_opaque: cannot pass {vt.debug_repr() if hasattr(vt, 'debug_repr') else vt} "
        f"to an opaque op while tracing with Dynamo; pass tensors and plain values."
    )


def _arg_trackers(fn, tx, args, kwargs) -> list:
    from torch._dynamo.variables import ConstantVariable, VariableTracker

    if kwargs:
        bound = fn.signature.bind(*args, **kwargs)
        arg_vts = []
        for n in fn.arg_names:
            if n in bound.arguments:
                arg_vts.append(bound.arguments[n])
            else:
                arg_vts.append(ConstantVariable.create(fn.defaults[n]))
        return arg_vts
    arg_vts = list(args)
    for n in fn.arg_names[len(arg_vts) :]:
        if n not in fn.defaults:
            raise TypeError(f"torch_opaque: {fn.display_name}.apply() missing argument '{n}'")
        arg_vts.append(VariableTracker.build(tx, fn.defaults[n]))
    return arg_vts


def _emit(tx, fn, arg_vts, ov):
    from torch._dynamo.variables import VariableTracker
    from torch._dynamo.variables.lists import TupleVariable

    op_vt = VariableTracker.build(tx, ov.op)
    out = op_vt.call_function(tx, arg_vts, {})
    if ov.dirty:
        return _in_place_results(fn, arg_vts, ov, out)
    if ov.returns_tuple and ov.n_out == 1:
        out = TupleVariable([out])
    return out


def _in_place_results(fn, arg_vts, ov, out):
    """Note [In-place Functions] (torch_opaque/_impl/in_place.py): the op
    returns the outputs it does not write into arguments; each modified
    argument takes its place in the Function's result."""
    from torch._dynamo.variables.lists import TupleVariable

    from .._impl import in_place

    n_rest = ov.n_out - len(ov.dirty)
    rest = [] if n_rest == 0 else list(out.items) if n_rest > 1 else [out]
    outs = in_place.place_arguments(ov.dirty, ov.n_out, arg_vts, rest)
    return TupleVariable(outs) if ov.returns_tuple else outs[0]


class _SideEffect(Exception):
    """A forward side effect seen while Dynamo meets an auto-registered class."""


def _compiling(tx) -> bool:
    """torch.compile rather than strict torch.export, which keeps the op
    (Note [Forward side effects] in _impl/side_effects.py)."""
    output = getattr(tx, "output", None)
    return not getattr(output, "export", False) and not torch.compiler.is_exporting()


def _runs_stock(tx, fn, args, kwargs) -> bool:
    """Whether this call runs as the stock Function under auto() (DTensor
    arguments and no sharding rule: said once); a wrapped class's call that
    an integration refuses raises here (Note [Extension points])."""
    if not (_ep.before_call or _ep.auto_runs_stock):
        return False
    try:
        examples = [_example(vt) for vt in _arg_trackers(fn, tx, args, kwargs)]
    except Exception:  # (reported by the paths below)
        return False
    if fn.explicit:
        _ep.check_call(fn, examples)
        return False
    return _ep.runs_stock_in_auto(fn.cls, examples)


def _refuse(fn, effect: str):
    """A class wrapped explicitly whose forward has side effects, under torch.compile."""
    from ..errors import UnsupportedError

    return UnsupportedError(
        f"torch_opaque: {fn.display_name} is wrapped as the op {fn.namespace}::{fn.name}, but "
        f"its forward {effect}. Under torch.compile the op's forward runs only as a fake "
        f"kernel, outside Dynamo's side-effect tracking, so that effect would be lost or "
        f"would leak FakeTensors. Return the value as an output of the forward instead, or "
        f"leave {fn.display_name} unwrapped under torch.compile (torch_opaque.auto() keeps "
        f"such a class an ordinary Function there)."
    )


def _fall_back(fn, effect: str) -> None:
    """auto(): the class stays an ordinary Function, which stock Dynamo traces
    (keeping its custom backward); the AutoReport lists it as an op only if
    an overload of it ever ran as one."""
    from .._impl import auto_mode as auto

    cls = fn.cls
    auto.fall_back(
        cls, f"its forward {effect}, which torch.compile keeps only when Dynamo traces the forward itself"
    )
    if not fn.auto_checked:
        for report in auto._reports():
            report.ops.pop(cls, None)


def _side_effect(fn, tx, args, kwargs) -> "str | None":
    """What the forward changes besides its outputs, seen in an eager call or
    in its bytecode (Note [Forward side effects])."""
    from .._impl import side_effect_scan

    effect = getattr(fn, "side_effects", None) or side_effect_scan.static(fn)
    if effect or not side_effect_scan.argument_calls(fn):
        return effect
    try:  # the kinds of the arguments (a list argument's .append)
        examples = [_example(vt) for vt in _arg_trackers(fn, tx, args, kwargs)]
    except Exception:  # (an argument no op takes: refused or fallen back later)
        return None
    return side_effect_scan.on_arguments(fn, examples)


def _watched(fn, examples, run):
    """``run()``, which may run the forward on fake tensors; a side effect
    seen there is recorded on ``fn`` and raised (Note [Forward side effects])."""
    from .._impl import side_effects

    with side_effects.quiet(fn, examples) as watch:  # Note [Fake runs leave no trace]
        out = run()
    effect = watch.effect
    if effect:
        fn.side_effects = getattr(fn, "side_effects", None) or effect
        if not fn.explicit:
            raise _SideEffect(effect)
        if not side_effects.outside_call(effect):
            raise _refuse(fn, effect)
    return out


def _kept_opaque(fn, effect: str) -> None:
    """A class wrapped explicitly whose forward changes state outside the call
    (a global, a closure variable, a class): the op is emitted and stays an
    opaque call at run time (never inlined into Inductor's graph,
    Note [Inductor sees through opaque ops]), so its kernel runs the forward,
    and its effect, once per call, as stock's compiled code does; the fake
    runs of tracing leave no trace (Note [Fake runs leave no trace])."""
    from .._impl import side_effects

    if not side_effects.outside_call(effect):
        raise _refuse(fn, effect)
    fn.side_effects = getattr(fn, "side_effects", None) or effect


def _routed_call_apply(original):
    from .._impl import auto_mode as auto

    def call_apply(self, tx, args, kwargs):
        cls = self.fn_cls
        fn = auto.routed(cls)
        if fn is None:
            if auto.active():
                auto.warn_if_traced_inline(cls)
            return original(self, tx, args, kwargs)
        if _runs_stock(tx, fn, args, kwargs):  # Note [Sharding opaque ops]
            return original(self, tx, args, kwargs)  # this call only
        compiling = _compiling(tx)
        effect = _side_effect(fn, tx, args, kwargs) if compiling else None
        if effect and fn.explicit:
            _kept_opaque(fn, effect)
        elif effect:  # before any fake run of the forward
            _fall_back(fn, effect)
            return original(self, tx, args, kwargs)
        if fn.explicit:
            arg_vts = _arg_trackers(fn, tx, args, kwargs)
            examples = [_example(vt) for vt in arg_vts]
            if compiling:
                ov = _watched(fn, examples, lambda: fn.overload_for(examples))
            else:
                ov = fn.overload_for(examples)
            return _emit(tx, fn, arg_vts, ov)
        try:  # Note [Auto fall-back]: nothing is emitted before this succeeds
            arg_vts = _arg_trackers(fn, tx, args, kwargs)
            examples = [_example(vt) for vt in arg_vts]

            def define():
                ov = fn.overload_for(examples)
                if ov.name not in fn.auto_checked:  # first trace of this overload: its
                    auto.check_recording(ov, examples)  # fake forward, recording ctx
                return ov

            ov = _watched(fn, examples, define) if compiling else define()
            fn.auto_checked.add(ov.name)
        except _SideEffect as e:
            _fall_back(fn, str(e))
            return original(self, tx, args, kwargs)
        except Exception as e:
            auto.fall_back(cls, auto._why(e))
            auto.warn_if_traced_inline(cls)
            return original(self, tx, args, kwargs)
        return _emit(tx, fn, arg_vts, ov)

    return call_apply


def _function_class(vt):
    """The Function class a variable tracker stands for, or None."""
    cls = getattr(vt, "fn_cls", None) or getattr(vt, "value", None)
    return cls if isinstance(cls, torch.autograd.function.FunctionMeta) else None


def _as_apply_call(tx, cls_vt, args, kwargs):
    from torch._dynamo.variables.misc import AutogradFunctionVariable

    cls = _function_class(cls_vt)
    vt = cls_vt if isinstance(cls_vt, AutogradFunctionVariable) else None
    if vt is None:
        vt = AutogradFunctionVariable(cls, source=getattr(cls_vt, "source", None))
    return vt.call_apply(tx, list(args), dict(kwargs))


def _routed_function_call(original):
    """Calls of the rerouted Function.apply that Dynamo did not recognise as
    ``Cls.apply`` (an alias bound before wrap): the class's call_apply."""
    from .._impl.apply_route import is_apply

    def call_function(self, tx, args, kwargs):
        if is_apply(getattr(self, "fn", None)):
            obj = getattr(self, "obj", None)
            if obj is not None and _function_class(obj) is not None:
                return _as_apply_call(tx, obj, args, kwargs)
            if obj is None and args and _function_class(args[0]) is not None:
                return _as_apply_call(tx, args[0], args[1:], kwargs)
        return original(self, tx, args, kwargs)

    return call_function


def install() -> None:
    """Patch Dynamo once; a warning and no patch when its internals are not as expected."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._dynamo.variables.functions import UserFunctionVariable, UserMethodVariable
        from torch._dynamo.variables.misc import AutogradFunctionVariable
    except Exception as e:  # pragma: no cover - Dynamo unavailable
        warnings.warn(f"torch_opaque: Dynamo hooks not installed ({e}); compile inlines wrapped Functions.")
        return
    missing = [
        f"{c.__name__}.{m}"
        for c, m in (
            (AutogradFunctionVariable, "call_apply"),
            (UserMethodVariable, "call_function"),
            (UserFunctionVariable, "call_function"),
        )
        if not callable(c.__dict__.get(m))
    ]
    if missing:  # pragma: no cover - another torch version
        warnings.warn(
            f"torch_opaque: torch {torch.__version__} has no {', '.join(missing)}; wrapped "
            f"Functions are not routed under torch.compile / strict export. Use non-strict "
            f"export, or report this torch version."
        )
        return
    AutogradFunctionVariable.call_apply = _routed_call_apply(AutogradFunctionVariable.call_apply)
    UserMethodVariable.call_function = _routed_function_call(UserMethodVariable.call_function)
    UserFunctionVariable.call_function = _routed_function_call(UserFunctionVariable.call_function)
    from . import compiled_double_backward

    compiled_double_backward.install()  # Note [Double backward in compiled graphs]


# Installs the hook right after ``torch._dynamo`` has been imported.
_WATCHER = AfterFirstImport("torch._dynamo", lambda module: install())


def install_when_dynamo_loads() -> None:
    """Install now if torch._dynamo is loaded, else when it is first imported."""
    if "torch._dynamo" in sys.modules and hasattr(sys.modules["torch._dynamo"], "reset"):
        install()
    else:
        _WATCHER.arm()
