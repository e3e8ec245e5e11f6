"""``torch.jit.script`` of code that calls ``Cls.apply`` of a wrapped Function.

Note [TorchScript and wrapped classes]
TorchScript resolves every free name of the code it compiles through a
resolution callback made by ``torch._jit_internal.createResolutionCallbackFromEnv``
(what ``createResolutionCallbackFromClosure`` and ``...FromFrame`` return,
for modules' methods and for functions alike). For a stock Function class,
``Cls.apply(x)`` becomes a Python call node (``^Cls()``) that runs the class
in Python: the values and the custom backward are right, but
``torch.jit.save`` refuses it ("Could not export Python function call"). A
wrapped class's ``apply`` is torch_opaque's C-level method, which TorchScript
does not take apart ("attribute lookup is not defined on python value of type
'FunctionMeta'") for a class made with ``type()``, and a Python call node
otherwise.

We wrap the callbacks that function makes: where a name resolves to a class
whose calls run its op (wrapped, or met inside ``auto()`` while scripting:
``auto.routed``), the callback returns a namespace whose ``apply`` is the op's
overload packet ``torch.ops.<ns>.<Name>``, which TorchScript scripts as it
scripts ``torch.ops.<ns>.<Name>(...)`` written out: the scripted graph holds
the op call, picks the overload by the argument types, fills in defaults from
the schema, and saves and loads (the op must be registered in the loading
process, as for every custom op). Other attributes of the class are read
from the class. An alias ``f = Cls.apply`` resolves to the packet itself.

The overloads must exist when the code is scripted: those of earlier eager
calls, or the one from complete type hints (Note [Registered at
decoration]). A class with none gets an error naming it and both fixes. A
Function whose scripted result would differ from stock's (one output
returned as a 1-tuple, which the op returns as a Tensor; an in-place
Function, whose result is an argument) is refused with an error. Inside
``auto()`` each of these keeps the stock Python call, with a warning.
"""

from __future__ import annotations

import types
import warnings

import torch

from ..errors import SchemaError, UnsupportedError

_installed = False


class _ApplyNamespace(types.ModuleType):
    """What a wrapped class resolves to in scripted code: ``apply`` is its op's
    overload packet, other attributes are the class's."""

    def __init__(self, cls, packet):
        super().__init__(f"torch_opaque.scripted.{cls.__qualname__}")
        self.apply = packet
        self._cls = cls

    def __getattr__(self, name):
        return getattr(self.__dict__["_cls"], name)


def _wrapped_class(value):
    """(class, bound apply alias?) when ``value`` is a Function class, or an
    alias of its ``apply``; else (None, False)."""
    if isinstance(value, torch.autograd.function.FunctionMeta):
        return value, False
    owner = getattr(value, "__self__", None)
    if isinstance(owner, torch.autograd.function.FunctionMeta) and getattr(value, "__name__", None) == "apply":
        return owner, True
    return None, False


def _packet(cls):
    """The overload packet scripted code calls for ``cls.apply``, or None (stock)."""
    from .._impl import auto_mode as auto

    fn = auto.routed(cls)
    if fn is None:
        return None
    problem = None
    if not fn.overloads:
        fn.define_from_hints()
    overloads = [ov for ov in fn.overloads.values() if ov.claimed_by is None]
    if not overloads:
        problem = SchemaError(
            f"torch_opaque: {cls.__qualname__} is wrapped as the op {fn.namespace}::{fn.name}, "
            f"but no overload of it is defined yet, so torch.jit.script cannot type its "
            f"{cls.__qualname__}.apply call. Call {cls.__qualname__}.apply once eagerly with "
            f"arguments of the kinds the scripted code passes before scripting, or annotate all "
            f"of forward's arguments and its return (-> torch.Tensor) so the op is defined when "
            f"the class is wrapped."
        )
    elif fn.dirty:
        problem = UnsupportedError(
            f"torch_opaque: {cls.__qualname__} modifies its arguments in place (ctx.mark_dirty); "
            f"its op returns other tensors than {cls.__qualname__}.apply does, so torch.jit.script "
            f"cannot call it for {cls.__qualname__}.apply. Use torch.export, or leave it unwrapped."
        )
    elif any(ov.returns_tuple and ov.n_out == 1 for ov in overloads):
        problem = UnsupportedError(
            f"torch_opaque: {cls.__qualname__}.forward returns a 1-tuple, and its op returns a "
            f"Tensor; torch.jit.script would call the op and give a Tensor where "
            f"{cls.__qualname__}.apply gives a tuple. Return the tensor itself, or call "
            f"torch.ops.{fn.namespace}.{fn.name} in the scripted code."
        )
    if problem is not None:
        if fn.explicit:
            raise problem
        warnings.warn(
            f"torch_opaque.auto(): {cls.__qualname__} stays a Python call in scripted code "
            f"({str(problem).removeprefix('torch_opaque: ')})",
            stacklevel=4,
        )
        return None
    return getattr(getattr(torch.ops, fn.namespace), fn.name)


def resolve(value):
    """What scripted code sees for ``value`` (Note [TorchScript and wrapped classes])."""
    cls, alias = _wrapped_class(value)
    if cls is None:
        return value
    packet = _packet(cls)
    if packet is None:
        return value
    return packet if alias else _ApplyNamespace(cls, packet)


def _routed(make_rcb):
    def createResolutionCallbackFromEnv(lookup_base):
        rcb = make_rcb(lookup_base)

        def resolution_callback(name):
            return resolve(rcb(name))

        return resolution_callback

    createResolutionCallbackFromEnv.__wrapped__ = make_rcb
    createResolutionCallbackFromEnv.__doc__ = make_rcb.__doc__
    return createResolutionCallbackFromEnv


def install() -> None:
    """Route TorchScript's name resolution, once; a warning and no patch when
    torch._jit_internal is not as expected."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch import _jit_internal

    from .. import _compat

    _compat.hide_ctx_properties_from_torchscript()  # Note [ctx properties TorchScript cannot compile]

    make = getattr(_jit_internal, "createResolutionCallbackFromEnv", None)
    users = ("createResolutionCallbackFromClosure", "createResolutionCallbackFromFrame")
    if not callable(make) or any(
        "createResolutionCallbackFromEnv" not in getattr(getattr(_jit_internal, u, None), "__code__", types.SimpleNamespace(co_names=())).co_names
        for u in users
    ):  # pragma: no cover - another torch version
        warnings.warn(
            f"torch_opaque: torch {torch.__version__}'s torch._jit_internal does not resolve names "
            f"through createResolutionCallbackFromEnv; torch.jit.script keeps Cls.apply of wrapped "
            f"classes a Python call. Call torch.ops.<namespace>.<Name> in scripted code instead."
        )
        return
    _jit_internal.createResolutionCallbackFromEnv = _routed(make)
