"""The registry of wrapped classes: which OpaqueFunction a class or an op name
has, and the release of the ops of classes that were garbage collected
(Note [Registry lifetime])."""

from __future__ import annotations

import hashlib
import re
import sys
import threading

import torch

from .._native import _C
from . import extension_points as _ep

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


def function_for_op(namespace: str, name: str):
    """The OpaqueFunction whose ops are ``namespace::name`` (and its _fwd / _bwd),
    if a Python Function defines them in this process (the registry's one reader
    outside this module)."""
    return _BY_OPNAME.get((namespace, name))


def lookup(cls: type):
    """The OpaqueFunction of a class wrapped explicitly or met in auto mode, or None."""
    fn = _BY_ID.get(id(cls))
    return fn if fn is not None and fn.cls_ref() is cls else None


def is_wrapped(cls: type) -> bool:
    """Whether ``cls.apply`` always runs its op (torch_opaque.op / wrap)."""
    fn = lookup(cls)
    return fn is not None and fn.explicit


def add(fn) -> None:
    """Enter a new OpaqueFunction under its class and its op name (under _LOCK)."""
    _BY_ID[id(fn.cls)] = fn
    _BY_OPNAME[(fn.namespace, fn.name)] = fn


def default_name(cls: type) -> str:
    """``<Qualname>_<6 hex digits of the module>``: stable across processes and
    distinct for equal class names in different modules."""
    qual = re.sub(r"\W", "_", cls.__qualname__.replace(".<locals>.", "_").replace(".", "_"))
    digest = hashlib.sha1(cls.__module__.encode()).hexdigest()[:6]
    return f"{qual}_{digest}"


def _free_name(namespace: str, base: str) -> str:
    """``base``, or ``base_2``, ``base_3``... when a live class holds it (a factory
    making one class per call: each gets its own op)."""
    name, k = base, 1
    while (namespace, name) in _BY_OPNAME:
        k += 1
        name = f"{base}_{k}"
    return name


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


def _forget(fn) -> None:
    if _BY_OPNAME.get((fn.namespace, fn.name)) is fn:
        del _BY_OPNAME[(fn.namespace, fn.name)]
    for ov in fn.overloads.values():
        _ep.fire(_ep.overload_forgotten, ov)  # Note [Extension points]
    fn.lib._destroy()
    from torch._library import simple_registry

    for ov in fn.overloads.values():  # the (now empty) fake-kernel entries
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

