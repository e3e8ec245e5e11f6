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
attribute the op's output never had), or leaks FakeTensors into user objects
(a global list that collects FakeTensors at each trace). Stock Dynamo traces
such a forward itself and replays its effects, so under torch.compile these
Functions are not emitted as the op: inside ``auto()`` the class falls back
(Note [Auto fall-back]), and a class wrapped explicitly is refused with
UnsupportedError (hooks/dynamo.py). Eager calls and torch.export keep the op:
in eager mode the forward runs for real and its effects happen as in stock.

What is seen, and when:
- ``Watch`` (dynamic), around the forward's one real run of an eager first
  call (Note [First call runs forward once]): the Python ``__dict__`` of the
  outputs (a fresh output with attributes, or an input returned with new
  ones), of argument tensors and argument objects; the length and item
  identities of list / dict / set arguments; the binding of each global the
  forward's code names (``co_names``, nested code included) and of each
  closure cell, and for bound containers and plain objects, their items /
  ``__dict__`` by identity (one level deep). The same watch runs around the
  fake runs Dynamo's hook makes (outputs there are not seen). A change to a
  list argument is lost in eager mode too (the op's kernel passes the forward
  a new list): ``lost_in_eager`` refuses an explicit wrap at its first call
  and makes auto() fall back from the next call on.
- ``static`` (bytecode), for a first call that is traced (compile with no
  eager call before): ``STORE_GLOBAL`` / ``DELETE_GLOBAL``; ``STORE_DEREF`` /
  ``DELETE_DEREF`` of a free variable (a ``nonlocal``, not a local that an
  inner function captures); a mutating method (``append``, ``update``...)
  loaded right off a global or free variable bound to a list / dict / set /
  deque; ``STORE_SUBSCR`` into such a container loaded right before a simple
  key; ``STORE_ATTR`` on a global or free variable (not a class or module),
  on an argument other than ``ctx``, or on a local the forward returns
  (directly or in a returned tuple), as ``obj.a = v`` or ``obj.a += v``; a
  mutating method loaded right off an argument whose value in the call is a
  list / dict / set (``out.append(y)``, not a tensor's ``x.add(y)``:
  ``on_arguments``, with Dynamo's example values).
What is not seen: effects made in functions the forward calls (helpers,
methods of its arguments' objects), ``setattr`` calls, effects through
aliases (``log = LOG; log.append(x)``) or computed containers
(``LOG[i].append(x)``), changes deeper than one level, items set into
arguments statically, and attributes of classes and modules (a counter such
as ``Cls.calls += 1``: instrumentation that tests of eager code use; the
watch does not snapshot classes and modules either). The watch sees some of
these (setattr, aliases) when the forward runs before Dynamo meets it. These
are the limits of a conservative check: it flags what it can name (no false
positives on ctx attributes, ``save_for_backward``, local lists, module
functions like ``torch.add``), and a Function it misses behaves under compile
as it did before this check.
"""

from __future__ import annotations

import collections
import collections.abc
import dis
import inspect
import os
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


def user_functions(fn) -> list:
    """(function, takes ctx first) for the Python functions of a Function class
    whose effects count: forward (and setup_context), each with the functions
    it wraps (functools.wraps)."""
    cls = fn.cls
    funcs = [(cls.forward, not fn.setup_style)]
    if fn.setup_style:
        funcs.append((cls.setup_context, True))
    out, seen = [], set()
    for f, has_ctx in funcs:
        while f is not None and id(f) not in seen:
            seen.add(id(f))
            # (torch's own wrappers, such as torch.compile's around a compiled
            # forward, are not the user's: their globals are Dynamo's state)
            if isinstance(f, types.FunctionType) and not f.__code__.co_filename.startswith(_TORCH_DIR):
                out.append((f, has_ctx))
            f = getattr(f, "__wrapped__", None)
    return out


# ---- dynamic: around one run ------------------------------------------------------


def _items(v):
    """Identities that change when container / object `v` changes one level deep."""
    try:
        if isinstance(v, collections.abc.MutableMapping):
            return ("map", len(v), tuple((id(k), id(x)) for k, x in v.items()))
        if isinstance(v, (collections.abc.MutableSequence, collections.deque)):
            return ("seq", len(v), tuple(map(id, v)))
        if isinstance(v, collections.abc.MutableSet):
            return ("set", len(v), frozenset(map(id, v)))
        if isinstance(v, (_OPAQUE_TYPES, torch.Tensor)) or not hasattr(v, "__dict__"):
            return None
        return ("obj", tuple((k, id(x)) for k, x in vars(v).items()))
    except Exception:  # an object whose __dict__ / items cannot be read
        return None


def _attrs(t) -> tuple:
    """A tensor's Python attributes (name, identity of value), less Dynamo's
    own marks: a ``torch.compile``d body that Dynamo runs marks the parameters
    it was given (``_dynamo_static_input_type``), which is not the user's effect."""
    d = getattr(t, "__dict__", None) or {}
    return tuple((k, id(x)) for k, x in d.items() if not k.startswith(_DYNAMO_MARK))


_DYNAMO_MARK = "_dynamo_"


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


class Watch:
    """Snapshot of what a forward could change, taken before it runs;
    ``found(outputs)`` after the run says what changed, or None."""

    def __init__(self, fn, values) -> None:
        self.values = list(values)
        self.args = []  # (index, value, snapshot)
        for i, v in enumerate(self.values):
            if isinstance(v, torch.Tensor):  # (fake / traced ones are the tracer's)
                if type(v) in (torch.Tensor, torch.nn.Parameter):
                    self.args.append((i, v, _attrs(v)))
            else:
                snap = _items(v)
                if snap is not None:
                    self.args.append((i, v, snap))
        self.names = fn.arg_names
        self.cells = []  # (description, getter, snapshot)
        for f, _ in user_functions(fn):
            g = f.__globals__
            for name in sorted(_names(f.__code__)):
                if name in g:
                    self._add(f"global '{name}'", _global(g, name))
            for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
                self._add(f"closure variable '{name}'", _cell(cell))

    def _add(self, what: str, get) -> None:
        v = get()
        self.cells.append((what, get, (v, _items(v))))  # (v held: no id reuse)

    def _arg_name(self, i) -> str:
        return f"'{self.names[i]}'" if i < len(self.names) else f"#{i}"

    # Whether the change found is one the op's later eager calls lose too: the
    # contents of a list argument (the kernel passes the forward a new list).
    lost_in_eager = False

    def found(self, outputs=None) -> Optional[str]:
        for i, v, snap in self.args:
            if isinstance(v, torch.Tensor):
                if _attrs(v) != snap:
                    return f"sets a Python attribute on its argument tensor {self._arg_name(i)}"
            elif _items(v) != snap:
                self.lost_in_eager = snap[0] != "obj"
                what = "changes the contents of" if snap[0] != "obj" else "sets an attribute of"
                return f"{what} its argument {self._arg_name(i)} (a {type(v).__name__})"
        for what, get, snap in self.cells:
            v = get()
            if v is not snap[0]:
                return f"rebinds the {what}"
            if _items(v) != snap[1]:
                return f"changes the {what} (a {type(v).__name__})"
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        inputs = {id(v): snap for _, v, snap in self.args if isinstance(v, torch.Tensor)}
        for k, o in enumerate(outs):
            if type(o) not in (torch.Tensor, torch.nn.Parameter) or id(o) in inputs:
                continue  # (an input returned: its attributes are checked above;
                # a subclass may keep its own state in __dict__)
            d = [name for name in (getattr(o, "__dict__", None) or ()) if not name.startswith(_DYNAMO_MARK)]
            if d:
                where = "its output" if len(outs) == 1 else f"its output {k}"
                return f"sets a Python attribute on {where} (.{d[0]})"
        return None


_MISSING = object()


def _global(g, name):
    return lambda: g.get(name, _MISSING)


def _cell(cell):
    def get():
        try:
            return cell.cell_contents
        except ValueError:  # an empty cell
            return _MISSING

    return get


def lost_in_eager(fn, effect: str) -> None:
    """An eager first call whose forward changed a list argument: the op's
    kernel passes later calls' forwards a new list, so the change would
    happen on this call only. A class wrapped explicitly is refused (before
    an overload is defined, so every call says so); in auto() the class falls
    back from its next call on (this call's result and change stand, the
    forward having run once, as in stock)."""
    if not fn.explicit:
        from ..hooks import auto

        auto.fall_back(fn.cls, f"its forward {effect}, which the op's later calls would not repeat")
        return
    from ..errors import UnsupportedError

    raise UnsupportedError(
        f"torch_opaque: {fn.display_name}.forward {effect}: the op {fn.namespace}::{fn.name} "
        f"passes its forward a new list at each call, so that change would be lost from the "
        f"next call on. Return the new items as outputs of the forward instead, or keep "
        f"{fn.display_name} unwrapped."
    )


# ---- static: the bytecode -------------------------------------------------------------


def static(fn) -> Optional[str]:
    """A side effect the bytecode of the Function's forward shows, or None
    (Note [Forward side effects]); the scan is cached on the OpaqueFunction."""
    return _scanned(fn)[0]


def on_arguments(fn, values) -> Optional[str]:
    """A mutating method the forward's bytecode calls on an argument that is
    a list / dict / set in this call (``out.append(y)``; ``x.add(y)`` on a
    tensor is not one), or None. `values`: the call's arguments (example
    values while tracing)."""
    for name, method in _scanned(fn)[1]:
        i = fn.arg_names.index(name) if name in fn.arg_names else len(values)
        if i < len(values) and isinstance(values[i], _CONTAINERS):
            return f"calls .{method}() on its argument '{name}' (a {type(values[i]).__name__})"
    return None


def _scanned(fn) -> tuple:
    """(finding or None, ((argument, method), ...)) of the forward's bytecode."""
    cached = fn.__dict__.get("_static_side_effects")
    if cached is None:
        found, calls = None, []
        for f, has_ctx in user_functions(fn):
            params = list(inspect.signature(f, follow_wrapped=False).parameters)
            ctx = params[0] if params and has_ctx else None
            found = _scan(f, f.__code__, set(params) - {ctx}, set(f.__code__.co_freevars), True, calls)
            if found:
                break
        cached = fn._static_side_effects = (found, tuple(calls))
    return cached


def _value(f, name, free: bool):
    """The current value of global or free variable `name` of `f`, or _MISSING."""
    if free:
        try:
            cell = f.__closure__[f.__code__.co_freevars.index(name)]
            return cell.cell_contents
        except (ValueError, IndexError, TypeError):
            return _MISSING
    g = f.__globals__
    if name in g:
        return g[name]
    b = g.get("__builtins__")
    b = vars(b) if isinstance(b, types.ModuleType) else (b or {})
    return b.get(name, _MISSING)


def _loaded(ins, f, params, free):
    """(description, value) of what instruction `ins` loads from outside the
    forward (a global, a free variable, an argument), else None."""
    op, name = ins.opname, ins.argval
    if isinstance(name, tuple):  # LOAD_FAST_LOAD_FAST (3.13): the last one is on top
        name = name[-1]
    if op == "LOAD_GLOBAL" or op == "LOAD_NAME":
        return f"global '{name}'", _value(f, name, free=False)
    if op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and name in free:
        return f"closure variable '{name}'", _value(f, name, free=True)
    if op.startswith("LOAD_FAST") and name in params:
        return f"argument '{name}'", _MISSING
    return None


def _returned(instrs) -> set:
    """Names of locals the code returns, alone or in a tuple literal."""
    out = set()
    for i, ins in enumerate(instrs):
        if ins.opname != "RETURN_VALUE" or i == 0:
            continue
        prev = instrs[i - 1]
        loads = [prev]
        if prev.opname == "BUILD_TUPLE" and prev.arg:
            loads = instrs[max(0, i - 1 - prev.arg) : i - 1]
        for ld in loads:
            if ld.opname.startswith("LOAD_FAST"):
                names = ld.argval if isinstance(ld.argval, tuple) else (ld.argval,)
                out.update(names)
    return out


def _scan(f, code, params, free, top, arg_calls) -> Optional[str]:
    instrs = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    returned = _returned(instrs) - params if top else set()
    for k, ins in enumerate(instrs):
        op = ins.opname
        prev = instrs[k - 1] if k else None
        if op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            return f"assigns the global '{ins.argval}'"
        if op in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in free:
            return f"assigns the closure variable '{ins.argval}' (nonlocal)"
        if op in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in _MUTATORS and prev is not None:
            src = _loaded(prev, f, params, free)
            if src is not None and isinstance(src[1], _CONTAINERS):
                return f"calls .{ins.argval}() on the {src[0]}"
            if src is not None and src[0].startswith("argument"):
                arg_calls.append((src[0].split("'")[1], ins.argval))
        if op == "STORE_SUBSCR" and k >= 2 and _simple_load(prev):
            src = _loaded(instrs[k - 2], f, params, free)
            if src is not None and isinstance(src[1], _CONTAINERS):
                return f"sets an item of the {src[0]}"
        if op == "STORE_ATTR" and prev is not None:
            target = _attr_target(instrs, k)
            if target is None:
                continue
            src = _loaded(target, f, params, free)
            if src is not None and not isinstance(src[1], (type, types.ModuleType)):
                whose = "its" if src[0].startswith("argument") else "the"
                return f"sets the attribute .{ins.argval} of {whose} {src[0]}"
            names = target.argval if isinstance(target.argval, tuple) else (target.argval,)
            if (
                target.opname.startswith("LOAD_FAST")
                and names[-1] in returned
                and not hasattr(torch.Tensor, ins.argval)  # y.requires_grad = False
            ):
                return f"sets the Python attribute .{ins.argval} on its output '{names[-1]}'"
    for c in code.co_consts:  # comprehensions, lambdas, inner functions
        if isinstance(c, types.CodeType):
            found = _scan(f, c, set(), free - set(code.co_cellvars), False, arg_calls)
            if found:
                return found
    return None


def _simple_load(ins) -> bool:
    return ins is not None and ins.opname.startswith(("LOAD_CONST", "LOAD_FAST", "LOAD_GLOBAL", "LOAD_DEREF"))


def _attr_target(instrs, k):
    """The instruction that loaded the object of STORE_ATTR instrs[k]:
    ``obj.a = v`` (the load right before) or ``obj.a += v`` (load, COPY 1,
    LOAD_ATTR a, ..., SWAP 2, STORE_ATTR a)."""
    prev = instrs[k - 1]
    if prev.opname != "SWAP":
        return prev
    attr = instrs[k].argval
    for j in range(k - 3, -1, -1):
        ins = instrs[j]
        if (
            ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and ins.argval == attr
            and j >= 2
            and instrs[j - 1].opname == "COPY"
        ):
            return instrs[j - 2]
    return None


def argument_calls(fn) -> tuple:
    """((argument, method), ...): the mutating methods the forward's bytecode
    loads off its arguments, for ``on_arguments``."""
    return _scanned(fn)[1]
