"""Forwards whose effects reach past their outputs.

Note [Forward side effects]
An op's forward is a pure function of its arguments to the dispatcher: under
torch.compile Dynamo does not trace it but calls the op's fake kernel, which
runs the user's forward on FakeTensors, outside Dynamo's side-effect tracking,
possibly several times (a probe for the outputs, auto()'s recording check,
AOT's tracing), while the compiled code runs it again for real. A forward
that also changes something else, such as

- a Python attribute set on an output (pyro's ``QuantizeBernoulli`` sets
  ``hard._unquantize = soft`` and its caller reads it back), on an argument
  tensor or on an argument object,
- an item appended to (set in, removed from) a list / dict / set argument,
- a global or a closure cell (``nonlocal``) rebound, or a global / closure
  container or object changed (``LOG.append(x)``, ``CACHE[k] = v``,
  ``STATE.calls += 1``),

then loses that effect in the compiled program (the traced caller reads the
attribute the op's output never had), or would apply it at each fake run
rather than once per call. Stock Dynamo traces such a forward itself and
replays its effects, so under torch.compile:
- inside ``auto()`` the class falls back (Note [Auto fall-back]);
- a class wrapped explicitly whose forward changes state outside the call (a
  global, a closure variable, a class attribute, a global container or
  object: ``outside_call``) is emitted as the op, which stays an opaque call
  at run time (never inlined into Inductor's graph, inductor_inline.py): its
  kernel runs the forward, and the effect, once per call, as stock does;
- one whose forward changes an argument or sets attributes on an output is
  refused with UnsupportedError (integrations/dynamo.py): the traced caller would
  read what the op's fake outputs never had.
Eager calls and torch.export keep the op: in eager mode the forward runs for
real and its effects happen as in stock. Whatever the mode, the runs
torch_opaque makes for its own purposes leave no trace (Note [Fake runs
leave no trace], below).

What is seen, and when:
- ``Watch`` (dynamic), around the forward's one real run of an eager first
  call (Note [First call runs forward once]) and around every quiet run: the
  Python ``__dict__`` of the outputs (a fresh output with attributes, or an
  input returned with new ones), of argument tensors and argument objects;
  the length and item identities of list / dict / set arguments; the binding
  of each global the forward's code names (``co_names``, nested code
  included) and of each closure cell, and for bound containers, plain
  objects and the user's classes, their items / ``__dict__`` by identity (one
  level deep); the same for the user's functions the forward calls by a
  global name (``with_helpers``, two calls deep). A change to a list argument
  is lost in eager mode too (the op's kernel passes the forward a new list):
  ``lost_in_eager`` refuses an explicit wrap at its first call and makes
  auto() fall back from the next call on.
- ``static`` (bytecode, side_effect_scan.py, Note [Every store form]), for a
  first call that is traced (compile with no eager call before): every store
  into state that outlives the call, whatever its form (``d[k] = v``,
  ``d[k] += 1``, ``del d[k]``, ``obj.a += v``, ``global n; n += 1``,
  ``nonlocal``, ``LOG.append``, ``Cls.calls += 1``, a module's attribute),
  in the forward and in the helpers it calls; a mutating method or item store
  on an argument whose value in the call is a list / dict / set
  (``on_arguments``, with Dynamo's example values).
What is not seen: effects through aliases the bytecode cannot follow
(``log = LOG; log.append(x)``: the watch sees them), through methods of the
arguments' objects or functions not called by a global name, and changes
deeper than one level. These are the limits of a conservative check: it flags
what it can name (no false positives on ctx attributes,
``save_for_backward``, local lists, tensor methods, module functions like
``torch.add``), and a Function it misses behaves under compile as it did
before this check.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import functools
import os
import sys
import threading
import types
from typing import Optional

import torch

# Method names that change a list / dict / set / deque in place.
_MUTATORS = frozenset(
    "append extend insert pop remove clear update setdefault popitem add discard "
    "sort reverse appendleft extendleft popleft rotate __setitem__ __delitem__ "
    "__iadd__ intersection_update difference_update symmetric_difference_update".split()
)
_CONTAINERS = (
    collections.abc.MutableSequence,
    collections.abc.MutableMapping,
    collections.abc.MutableSet,
    collections.deque,
)
_OPAQUE_TYPES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    staticmethod,
    classmethod,
)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # torch_opaque/


def user_functions(fn) -> list:
    """(function, takes ctx first) for the Python functions of a Function class
    whose effects count: forward (and setup_context), each with the functions
    it wraps (functools.wraps)."""
    cls = fn.cls
    funcs = [(cls.forward, not fn.setup_style)]
    if fn.setup_style:
        funcs.append((cls.setup_context, True))
    return _unwrapped(funcs)


def _unwrapped(funcs) -> list:
    """(function, has ctx) pairs: each function with those it wraps, the user's only,
    and the helpers they call (with_helpers)."""
    out, seen = [], set()
    todo = list(funcs)
    while todo:
        f, has_ctx = todo.pop(0)
        while f is not None and id(f) not in seen:
            seen.add(id(f))
            # (torch's own wrappers, such as torch.compile's around a compiled
            # forward, are not the user's: their globals are Dynamo's state;
            # torch_opaque's own, such as auto()'s guarded backward, hold the
            # user's function in a closure cell: their registries are ours)
            if isinstance(f, types.FunctionType) and f.__code__.co_filename.startswith(_OWN_DIR):
                for cell in f.__closure__ or ():
                    v = _cell(cell)[0]()
                    if isinstance(v, types.FunctionType):
                        todo.append((v, has_ctx))
            elif isinstance(f, types.FunctionType) and not f.__code__.co_filename.startswith(_TORCH_DIR):
                out.append((f, has_ctx))
            f = getattr(f, "__wrapped__", None)
    return with_helpers(out)


def with_helpers(funcs: list, depth: int = 2, limit: int = 32) -> list:
    """`funcs` ((function, has ctx), ...) and the user's functions they call by
    a global name (``_bump()``, module helpers), `depth` calls deep, as
    (function, None): their globals are state the forward changes too."""
    out, seen = list(funcs), {id(f) for f, _ in funcs}
    frontier = [f for f, _ in funcs]
    for _ in range(depth):
        nxt = []
        for f in frontier:
            g = f.__globals__
            for name in _names(f.__code__):
                h = g.get(name)
                if (
                    isinstance(h, types.FunctionType)
                    and id(h) not in seen
                    and not h.__code__.co_filename.startswith((_TORCH_DIR, _OWN_DIR))
                    and len(out) < limit
                ):
                    seen.add(id(h))
                    out.append((h, None))
                    nxt.append(h)
        frontier = nxt
    return out


# ---- dynamic: around one run ------------------------------------------------------


def _is_users_class(v) -> bool:
    """A class of the user's (not builtins', the standard library's or torch's),
    whose attributes a forward may use as state (``Counter.calls += 1``)."""
    if not isinstance(v, type):
        return False
    mod = sys.modules.get(getattr(v, "__module__", None) or "")
    path = getattr(mod, "__file__", None) or ""
    if not path:  # builtins, or a class made at run time: __main__-like
        return mod is not None and v.__module__ not in sys.builtin_module_names
    if path.startswith(_TORCH_DIR):
        return False
    return not path.startswith(_STDLIB) or any(d in path for d in ("site-packages", "dist-packages"))


_STDLIB = os.path.dirname(os.__file__) + os.sep  # (sysconfig would import more)


def _items(v):
    """Identities that change when container / object `v` changes one level deep."""
    try:
        if isinstance(v, collections.abc.MutableMapping):
            return ("map", len(v), tuple((id(k), id(x)) for k, x in v.items()))
        if isinstance(v, (collections.abc.MutableSequence, collections.deque)):
            return ("seq", len(v), tuple(map(id, v)))
        if isinstance(v, collections.abc.MutableSet):
            return ("set", len(v), frozenset(map(id, v)))
        if _is_users_class(v):
            return ("cls", tuple((k, id(x)) for k, x in vars(v).items()))
        if isinstance(v, (_OPAQUE_TYPES, torch.Tensor)) or not hasattr(v, "__dict__"):
            return None
        return ("obj", tuple((k, id(x)) for k, x in vars(v).items()))
    except Exception:  # an object whose __dict__ / items cannot be read
        return None


def _contents(v, kind: str):
    """What `_restore` puts back into `v` (of `_items` kind `kind`)."""
    if kind == "map":
        return list(v.items())
    if kind in ("seq", "set"):
        return list(v)
    return dict(vars(v))


def _restore(v, kind: str, contents) -> None:
    """Put `contents` back into container / object / class `v`, one level deep."""
    if kind == "map":
        v.clear()
        v.update(contents)
    elif kind == "seq":
        if isinstance(v, collections.deque):
            v.clear()
            v.extend(contents)
        else:
            v[:] = contents
    elif kind == "set":
        v.clear()
        v |= set(contents)
    else:
        _restore_attrs(v, contents)


def _restore_attrs(v, contents: dict) -> None:
    now = vars(v)
    for k in [k for k in now if k not in contents]:
        delattr(v, k)
    for k, x in contents.items():
        if now.get(k, _MISSING) is not x:
            setattr(v, k, x)


def _attrs(t) -> tuple:
    """A tensor's Python attributes (name, identity of value), less Dynamo's
    own marks: a ``torch.compile``d body that Dynamo runs marks the parameters
    it was given (``_dynamo_static_input_type``), which is not the user's effect."""
    d = getattr(t, "__dict__", None) or {}
    return tuple((k, id(x)) for k, x in d.items() if not k.startswith(_DYNAMO_MARK))


_DYNAMO_MARK = "_dynamo_"


@functools.lru_cache(maxsize=4096)
def _names(code) -> tuple:
    """The global names `code` (nested code included) uses, sorted (each fake run asks)."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.update(_names(c))
    return tuple(sorted(names))


def functions_of(*callables) -> list:
    """(function, None) for the user's Python functions among `callables`
    (with those they wrap), as ``user_functions`` gives them for a class."""
    return _unwrapped([(f, None) for f in callables])


class Watch:
    """Snapshot of what a forward could change, taken before it runs;
    ``found(outputs)`` after the run says what changed, or None; ``restore()``
    puts back what changed (Note [Fake runs leave no trace]).

    `fn`: the OpaqueFunction; or None with `functions` ((function, _), ...)
    and the argument `names`."""

    def __init__(self, fn, values, functions=None, names=()) -> None:
        self.values = list(values)
        self.args = []  # (index, value, snapshot, contents)
        for i, v in enumerate(self.values):
            if isinstance(v, torch.Tensor):  # (fake / traced ones are the tracer's)
                if type(v) in (torch.Tensor, torch.nn.Parameter):
                    self.args.append((i, v, _attrs(v), dict(getattr(v, "__dict__", None) or {})))
            else:
                snap = _items(v)
                if snap is not None:
                    self.args.append((i, v, snap, _contents(v, snap[0])))
        self.names = fn.arg_names if fn is not None else tuple(names)
        self.cells = []  # (description, getter, setter, snapshot, contents)
        for f, _ in user_functions(fn) if fn is not None else functions:
            g = f.__globals__
            for name in _names(f.__code__):
                if name in g:
                    self._add(f"global '{name}'", *_global(g, name))
            for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
                self._add(f"closure variable '{name}'", *_cell(cell))
        self.effect: Optional[str] = None  # found by quiet(), here or in a run inside

    def _add(self, what: str, get, put) -> None:
        v = get()
        snap = _items(v)
        contents = None if snap is None else _contents(v, snap[0])
        self.cells.append((what, get, put, (v, snap), contents))  # (v held: no id reuse)

    def _arg_name(self, i) -> str:
        return f"'{self.names[i]}'" if i < len(self.names) else f"#{i}"

    # Whether the change found is one the op's later eager calls lose too: the
    # contents of a list argument (the kernel passes the forward a new list).
    lost_in_eager = False

    def found(self, outputs=None) -> Optional[str]:
        for i, v, snap, _ in self.args:
            if isinstance(v, torch.Tensor):
                if _attrs(v) != snap:
                    return f"sets a Python attribute on its argument tensor {self._arg_name(i)}"
            elif _items(v) != snap:
                self.lost_in_eager = snap[0] not in ("obj", "cls")
                what = "changes the contents of" if self.lost_in_eager else "sets an attribute of"
                return f"{what} its argument {self._arg_name(i)} (a {type(v).__name__})"
        for what, get, _, snap, _ in self.cells:
            v = get()
            if v is not snap[0]:
                return f"rebinds the {what}"
            if _items(v) != snap[1]:
                if snap[1] is not None and snap[1][0] == "cls":
                    return f"sets a class attribute of the {what}"
                return f"changes the {what} (a {type(v).__name__})"
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        inputs = {id(v) for _, v, _, _ in self.args if isinstance(v, torch.Tensor)}
        for k, o in enumerate(outs):
            if type(o) not in (torch.Tensor, torch.nn.Parameter) or id(o) in inputs:
                continue  # (an input returned: its attributes are checked above;
                # a subclass may keep its own state in __dict__)
            d = [name for name in (getattr(o, "__dict__", None) or ()) if not name.startswith(_DYNAMO_MARK)]
            if d:
                where = "its output" if len(outs) == 1 else f"its output {k}"
                return f"sets a Python attribute on {where} (.{d[0]})"
        return None

    def restore(self) -> None:
        """Undo what changed since the snapshot, one level deep."""
        for _, v, snap, contents in self.args:
            if isinstance(v, torch.Tensor):
                if _attrs(v) != snap:
                    v.__dict__.clear()
                    v.__dict__.update(contents)
            elif _items(v) != snap:
                _restore(v, snap[0], contents)
        for _, get, put, (old, snap), contents in self.cells:
            if get() is not old:
                put(old)
            if snap is not None and _items(old) != snap:
                _restore(old, snap[0], contents)


_MISSING = object()


def _global(g, name):
    def put(v):
        if v is _MISSING:
            g.pop(name, None)
        else:
            g[name] = v

    return (lambda: g.get(name, _MISSING)), put


def _cell(cell):
    def get():
        try:
            return cell.cell_contents
        except ValueError:  # an empty cell
            return _MISSING

    def put(v):
        if v is _MISSING:
            del cell.cell_contents
        else:
            cell.cell_contents = v

    return get, put


# Note [Fake runs leave no trace]
# torch_opaque runs a user's forward for its own purposes: the probe that
# learns the outputs of a traced first call (on FakeTensors, or once for real
# when the forward cannot run on them), auto()'s recording check, the ops'
# fake kernels (called by torch.export, Dynamo and AOTAutograd, possibly
# several times per trace) and the real runs on stand-in data that a fake
# from real makes (Note [Fake from a real run]). Stock PyTorch makes none of
# these runs, so none may leave a trace in the user's state: a counter
# (``CALLS["n"] += 1``, ``Counter.calls += 1``, ``global n; n += 1``), a log
# that would collect FakeTensors, a stash. Each such run is ``quiet``: the
# Watch's snapshot (argument tensors' attributes; list / dict / set / object
# arguments; every global the code names and every closure cell, their
# bindings and, for containers, objects and the user's classes, their items
# one level deep) is taken before, and what changed is put back after, so a
# counter after N calls is what stock gives, eagerly and under compile. What
# changed is still reported (``Watch.effect``, to the quiet runs around this
# one too), so Dynamo's hook decides as if it had seen the effect: auto()
# falls back, an explicit wrap keeps the op when the state is outside the
# call (Note [Forward side effects]). Not put back: changes deeper than one
# level, made through functions the forward calls, or to modules' attributes
# (the bytecode scan names a store to a module's attribute, in
# side_effect_scan.py, so compile falls back before any fake run). The
# forward's one real run of an eager first call, and each run of its kernel,
# are the user's own calls: not quiet.

_quiet = threading.local()


@contextlib.contextmanager
def quiet(fn, values, functions=None, names=()):
    """A run made for torch_opaque's own purposes (Note [Fake runs leave no
    trace]): yields the Watch, whose ``effect`` says what the run changed
    (since put back)."""
    watch = Watch(fn, values, functions, names)
    stack = _quiet.__dict__.setdefault("stack", [])
    stack.append(watch)
    try:
        yield watch
    finally:
        stack.pop()
        effect = watch.found()
        if effect:
            watch.restore()
            for w in (watch, *stack):
                w.effect = w.effect or effect


def outside_call(effect: str) -> bool:
    """Whether `effect` changes state outside the call (a global, a closure
    variable, a class), which the op's kernel, run once per call, applies as
    stock does; not an argument's or an output's attributes, which the traced
    caller reads."""
    return " the global " in effect or " the closure variable " in effect


def lost_in_eager(fn, effect: str) -> None:
    """An eager first call whose forward changed a list argument: the op's
    kernel passes later calls' forwards a new list, so the change would
    happen on this call only. A class wrapped explicitly is refused (before
    an overload is defined, so every call says so); in auto() the class falls
    back from its next call on (this call's result and change stand, the
    forward having run once, as in stock)."""
    if not fn.explicit:
        from . import auto_state

        auto_state.fall_back(fn.cls, f"its forward {effect}, which the op's later calls would not repeat")
        return
    from ..errors import UnsupportedError

    raise UnsupportedError(
        f"torch_opaque: {fn.display_name}.forward {effect}: the op {fn.namespace}::{fn.name} "
        f"passes its forward a new list at each call, so that change would be lost from the "
        f"next call on. Return the new items as outputs of the forward instead, or keep "
        f"{fn.display_name} unwrapped."
    )
