"""Rerouting ``torch.autograd.Function.apply``, aliases included.

Note [Apply interception]
Packages often keep ``f = MyFunction.apply`` (at module level, in
``__init__``, in dicts) and call ``f`` later. Every such alias is a bound
method of one function object, ``torch.autograd.Function.apply.__func__``,
so binding it earlier or later makes no difference: whatever runs that
function's code sees every call. We therefore keep the function object (and
the ``Function.apply`` attribute) as they are and swap only its ``__code__``
for a two-line trampoline that calls ``route(cls, *args, **kwargs)``;
``route`` (torch_opaque._impl.routing.route_apply) runs the op of a wrapped class
(or, inside ``auto()``, of an eligible class) and otherwise calls
``ORIGINAL_APPLY``, a copy of the function with the original code and the
same closure, so stock behaviour is unchanged.

Why not replace the attribute: Dynamo recognises an alias by comparing it
with ``getattr(alias.__self__, "apply")``; with a different function there,
the comparison fails and tracing stops (``Unresolved GetAttrVariable
comparison``). A TorchFunctionMode does not see ``apply`` at all.

The original code has one free variable, ``__class__`` (its ``super()``);
the trampoline is compiled inside a class body so that it has the same one,
and the function keeps its closure. The trampoline finds ``route`` as a
global of torch.autograd.function, under a name torch does not use, with the
registry (``_BY_ID``) and auto mode's thread-local state.

Note [Inlined route check]
A trampoline that calls ``ORIGINAL_APPLY`` costs a stock (unrouted) call one
more Python frame with ``*args, **kwargs`` packed twice: about 2 µs on a
~22 µs call (benchmarks/bench_eager.py, ``--kinds stock``). So the code we
install is, where torch's source is at hand, Function.apply's own code with
the route check as its first statement (compiled from torch's source with
``ast``, line and column numbers kept, so tracebacks point at torch's file): an
unrouted call costs one dict look-up and one thread-local read more than
stock. Where the source is missing or not the expected shape, the two-line
trampoline above is used.

Note [Apply in C]
From torch 2.14 ``Function.apply`` is ``_C._FunctionBase``'s C classmethod (a
``classmethod_descriptor``): there is no Python code to swap. There we set the
attribute instead, ``Function.apply = classmethod(trampoline)``, once routing
is installed: every ``Cls.apply`` of a subclass (and every alias bound from
then on) is a bound method of the trampoline, which Dynamo recognises as
before. Unrouted calls go to the C method (``_torch_opaque_c_apply``), and
``ORIGINAL_APPLY`` calls it too. The trampoline's code is compiled under
torch.autograd.function's file name (tracebacks, Dynamo's skip rules: as for
the code of Note [Inlined route check]). Aliases bound before routing was
installed are the C method's and run the ordinary Function. With a Python
``Function.apply`` (torch 2.13) nothing of this is used.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import warnings
from typing import Callable, Optional

import torch

# The globals the trampoline reads, set in torch.autograd.function's namespace.
_GLOBAL = "_torch_opaque_route_apply"  # route(cls, *args, **kwargs)
_GLOBALS = (_GLOBAL, "_torch_opaque_original_apply", "_torch_opaque_by_id", "_torch_opaque_auto")
_APPLY = None  # torch.autograd.Function.apply.__func__, once checked

# Note [Apply in C]: Function.apply's C method where this torch defines it in C, else None.
_C_APPLY = inspect.getattr_static(torch.autograd.Function, "apply", None)
if not isinstance(_C_APPLY, types.ClassMethodDescriptorType):
    _C_APPLY = None


def _target() -> Optional[types.FunctionType]:
    """The function whose code we swap, or None (with a warning) when this
    torch version's Function.apply is not what Note [Apply interception] expects."""
    attr = inspect.getattr_static(torch.autograd.Function, "apply", None)
    func = getattr(attr, "__func__", None)
    problem = None
    if not isinstance(attr, classmethod) or not isinstance(func, types.FunctionType):
        problem = f"torch.autograd.Function.apply is a {type(attr).__name__}, not a classmethod"
    elif func.__code__.co_freevars != ("__class__",):
        problem = f"its code has free variables {func.__code__.co_freevars}, not ('__class__',)"
    elif any(g in func.__globals__ for g in _GLOBALS):
        problem = f"torch.autograd.function already defines {_GLOBAL}"
    if problem:
        warnings.warn(
            f"torch_opaque: cannot route aliases of autograd.Function.apply on torch "
            f"{torch.__version__} ({problem}); `f = Cls.apply` kept from before wrapping runs "
            f"the ordinary Function. Call Cls.apply directly, or report this torch version.",
            stacklevel=3,
        )
        return None
    return func


class _Template:
    def apply(cls, *args, **kwargs):
        __class__  # noqa: B018  the one free variable Function.apply's code has
        # Unrouted calls (no OpaqueFunction for cls, not inside auto() in this
        # thread) go straight to the original code: two C-level lookups.
        if _torch_opaque_by_id.get(id(cls)) is None and not _torch_opaque_auto.depth:  # noqa: F821
            return _torch_opaque_original_apply(cls, *args, **kwargs)  # noqa: F821
        return _torch_opaque_route_apply(cls, *args, **kwargs)  # noqa: F821


_TRAMPOLINE = _Template.apply.__code__.replace(co_name="apply", co_qualname="Function.apply")

# Note [Apply in C]: the Function.apply installed where torch's is a C method.
_C_SOURCE = """
def apply(cls, *args, **kwargs):
    if _torch_opaque_by_id.get(id(cls)) is None and not _torch_opaque_auto.depth:
        return _torch_opaque_c_apply(cls, *args, **kwargs)
    return _torch_opaque_route_apply(cls, *args, **kwargs)
"""


def _c_trampoline() -> types.CodeType:
    """_C_SOURCE compiled as if written in torch.autograd.function, on the line
    ``apply = _C._FunctionBase.__dict__["apply"]`` (else the class's first line):
    tracebacks point there, and Dynamo skips the frame as it skips Function.apply's
    Python code in torch 2.13 (``torch.compile(Cls.apply)`` runs it eagerly)."""
    line, start, end = 1, 0, 0
    try:
        lines, first = inspect.getsourcelines(torch.autograd.Function)
        i = next((i for i, x in enumerate(lines) if x.strip().startswith("apply =")), 0)
        line, text = first + i, lines[i].rstrip()
        start, end = len(text) - len(text.lstrip()), len(text)  # the whole line: no carets
    except (OSError, TypeError):
        pass
    tree = ast.parse(_C_SOURCE)
    for node in ast.walk(tree):
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = line
            node.col_offset, node.end_col_offset = start, end
    module = compile(tree, torch.autograd.function.__file__, "exec", dont_inherit=True)
    (code,) = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    return code.replace(co_qualname="Function.apply")

# Note [Inlined route check]: the statement put first in Function.apply's code.
_CHECK = """
if _torch_opaque_by_id.get(id(cls)) is not None or _torch_opaque_auto.depth:
    return _torch_opaque_route_apply(cls, *args, **kwargs)
"""


def _inlined_trampoline(code: types.CodeType) -> Optional[types.CodeType]:
    """``code`` (Function.apply's) with _CHECK as its first statement, or None
    when its source is not available or not a plain ``def apply(cls, *args,
    **kwargs)`` (Note [Inlined route check])."""
    try:
        lines, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    fdef = tree.body[0] if len(tree.body) == 1 else None
    a = getattr(fdef, "args", None)
    if (
        not isinstance(fdef, ast.FunctionDef)
        or fdef.name != "apply"
        or [x.arg for x in a.args] != ["cls"]
        or a.vararg is None
        or a.vararg.arg != "args"
        or a.kwarg is None
        or a.kwarg.arg != "kwargs"
        or a.kwonlyargs
        or a.defaults
    ):
        return None
    indent = len(lines[0]) - len(lines[0].lstrip())
    for node in ast.walk(tree):  # columns as in torch's file (dedent removed `indent`)
        if hasattr(node, "col_offset"):
            node.col_offset += indent
            node.end_col_offset += indent
    check = ast.parse(_CHECK).body[0]
    ast.increment_lineno(check, fdef.lineno - check.lineno)  # on the def line
    fdef.body.insert(0, check)
    fdef.decorator_list = []
    ast.increment_lineno(tree, first - 1)
    holder = ast.ClassDef(
        name="Function", bases=[], keywords=[], body=[fdef], decorator_list=[],
        lineno=fdef.lineno, col_offset=0, end_lineno=fdef.end_lineno, end_col_offset=0,
    )
    module = ast.fix_missing_locations(ast.Module(body=[holder], type_ignores=[]))
    try:
        compiled = compile(module, code.co_filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):  # pragma: no cover - torch's own source compiles
        return None
    found = [
        c
        for body in compiled.co_consts
        if isinstance(body, types.CodeType)
        for c in body.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "apply"
    ]
    if len(found) != 1 or found[0].co_freevars != code.co_freevars:
        return None
    return found[0].replace(co_qualname="Function.apply")


def _c_original(c_apply) -> types.FunctionType:
    """Note [Apply in C]: ORIGINAL_APPLY where Function.apply is a C method."""

    def apply(cls, *args, **kwargs):
        return c_apply(cls, *args, **kwargs)

    apply.__qualname__ = "Function.apply"
    apply.__module__ = torch.autograd.function.__name__
    apply.__doc__ = c_apply.__doc__
    return apply


def _copy_original() -> types.FunctionType:
    if _C_APPLY is not None:
        return _c_original(_C_APPLY)
    func = torch.autograd.Function.apply.__func__
    code = func.__code__
    if code is _TRAMPOLINE or "_torch_opaque_by_id" in code.co_names:  # pragma: no cover
        # installed by another copy of this module
        raise RuntimeError("torch_opaque: Function.apply was rerouted twice")
    f = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    f.__kwdefaults__ = func.__kwdefaults__
    f.__qualname__ = func.__qualname__
    f.__doc__ = func.__doc__
    f.__module__ = func.__module__
    return f


# Stock Function.apply (its code, its closure): what unrouted calls run.
ORIGINAL_APPLY = _copy_original()


def install_apply_route(route: Callable, by_id: dict, auto_state) -> bool:
    """Make every call of ``Function.apply`` (aliases included) of a class in
    ``by_id`` (keyed by ``id(cls)``), or of any class while ``auto_state.depth``
    is set in the calling thread, go through ``route(cls, *args, **kwargs)``.
    Idempotent; False when torch's Function.apply is not as expected (nothing
    is changed then)."""
    global _APPLY
    if _APPLY is not None:
        return True
    if _C_APPLY is not None:
        return _install_c_route(route, by_id, auto_state)
    func = _target()
    if func is None:
        return False
    func.__globals__.update(
        {
            _GLOBAL: route,
            "_torch_opaque_original_apply": ORIGINAL_APPLY,
            "_torch_opaque_by_id": by_id,
            "_torch_opaque_auto": auto_state,
        }
    )
    func.__code__ = _inlined_trampoline(ORIGINAL_APPLY.__code__) or _TRAMPOLINE
    _APPLY = func
    return True


def _install_c_route(route: Callable, by_id: dict, auto_state) -> bool:
    """install_apply_route where Function.apply is a C method (Note [Apply in C])."""
    global _APPLY
    namespace = vars(torch.autograd.function)
    if inspect.getattr_static(torch.autograd.Function, "apply", None) is not _C_APPLY or any(
        g in namespace for g in _GLOBALS + ("_torch_opaque_c_apply",)
    ):
        warnings.warn(
            f"torch_opaque: cannot route autograd.Function.apply on torch {torch.__version__} "
            f"(it was replaced by someone else); `f = Cls.apply` and calls inside auto() run the "
            f"ordinary Function. Call Cls.apply of wrapped classes directly, or report this.",
            stacklevel=3,
        )
        return False
    namespace.update(
        {
            _GLOBAL: route,
            "_torch_opaque_original_apply": ORIGINAL_APPLY,
            "_torch_opaque_c_apply": _C_APPLY,
            "_torch_opaque_by_id": by_id,
            "_torch_opaque_auto": auto_state,
        }
    )
    func = types.FunctionType(_c_trampoline(), namespace, "apply")
    func.__qualname__ = "Function.apply"
    func.__doc__ = _C_APPLY.__doc__
    torch.autograd.Function.apply = classmethod(func)
    _APPLY = func
    return True


def is_apply(obj) -> bool:
    """Whether ``obj`` is the (rerouted) function behind every ``Cls.apply``."""
    return obj is not None and obj is getattr(torch.autograd.Function.apply, "__func__", None)
