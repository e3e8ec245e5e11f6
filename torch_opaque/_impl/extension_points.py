"""Where integrations attach to the core: the events the core announces.

Note [Extension points]
The core (an op family defined from a Function: its kernels, schema, fakes,
tracing, the registry of overloads and classes, the routing of ``apply``
calls and auto mode) knows no consumer of its ops. DTensor sharding,
autocast, Inductor, the ONNX registry, FX, TorchScript, Dynamo and wrapper
subclasses each live in one file of ``torch_opaque/integrations/`` and attach
here, once, from ``torch_opaque/integrations/__init__.py`` (the one place
that wires them, imported by ``import torch_opaque``). The core calls what is
attached at these points and imports nothing of ``integrations/``
(tests/test_layering.py checks it):

- ``overload_defined(overload)``: an overload's ops and kernels were just
  registered (end of ``Overload.__init__``), in the order attached;
- ``overload_forgotten(overload)``: a released overload's ops are being
  deregistered (Note [Registry lifetime]);
- ``before_call(fn, values)``: a call of a wrapped class on the Python path
  is about to run; may raise to refuse it;
- ``tracers``: objects with ``traces(values) -> bool`` and
  ``call(fn, values)``: a first call made while another tracer records the
  program (FX's Proxies) is handed to it;
- ``auto_runs_stock(cls, values) -> bool``: ``auto()`` runs this call as the
  stock Function (this call only);
- ``held_references(op) -> int``: references an integration's own tables
  hold to an op (Note [Ops that graphs hold] does not count them as a
  graph's);
- ``routing_installed()``: the first ``wrap``/``op``/``auto()`` of a process;
- ``library_loaded()``: ``torch_opaque.load_library`` is loading C++ ops;
- ``when_imported(module, then)``: Python has imported ``module`` (now, if it
  has already).

Each point is a tuple, rebuilt by ``attach``: the eager call path reads one
module attribute and loops over what is there (nothing, or one check), never
a look-up by name per call.
"""

from __future__ import annotations

import importlib.abc
import sys

overload_defined: tuple = ()
overload_forgotten: tuple = ()
before_call: tuple = ()
tracers: tuple = ()
auto_runs_stock: tuple = ()
held_references: tuple = ()
routing_installed: tuple = ()
library_loaded: tuple = ()

POINTS = (
    "overload_defined",
    "overload_forgotten",
    "before_call",
    "tracers",
    "auto_runs_stock",
    "held_references",
    "routing_installed",
    "library_loaded",
)


def attach(point: str, callback) -> None:
    """Add ``callback`` to the extension point ``point`` (once)."""
    if point not in POINTS:
        raise ValueError(
            f"torch_opaque: no extension point {point!r}; the core announces {', '.join(POINTS)} "
            f"(Note [Extension points] in torch_opaque/_impl/extension_points.py)."
        )
    current = globals()[point]
    if callback not in current:
        globals()[point] = current + (callback,)


def fire(point: tuple, *args) -> None:
    """Call every callback of an event point with ``args``."""
    for callback in point:
        callback(*args)


def check_call(fn, values) -> None:
    """Run the ``before_call`` checks (each may raise)."""
    for check in before_call:
        check(fn, values)


def traced_by(values):
    """The tracer that records a call with these values, or None."""
    for tracer in tracers:
        if tracer.traces(values):
            return tracer
    return None


def runs_stock_in_auto(cls: type, values) -> bool:
    """Whether auto() runs this call as the stock Function."""
    return any(check(cls, values) for check in auto_runs_stock)


def references_held(op) -> int:
    """References to ``op`` that integrations' tables hold."""
    return sum(count(op) for count in held_references)


class AfterFirstImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after module `name` has first been
    imported (executed in full), once; ``arm()`` puts it on sys.meta_path and
    it removes itself when it fires."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def arm(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(module)

        spec.loader.exec_module = exec_then
        return spec


def when_imported(name: str, then) -> None:
    """``then(module)`` now if ``name`` is imported, else right after Python first imports it."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        AfterFirstImport(name, then).arm()
