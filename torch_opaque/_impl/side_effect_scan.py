"""The bytecode scan of Note [Forward side effects] (side_effects.py): the
stores a forward's code makes into state that outlives the call.

Note [Every store form]
The scan follows each store instruction to the instruction that loaded its
target, walking the value stack back (``_producer``), so the form of the
store does not matter: ``d[k] = v``, ``d[f(x)] = v``, ``d[k] += 1``,
``del d[k]``, ``obj.a = v``, ``obj.a += v``. The target counts when it is
- a global or free variable (``nonlocal``) rebound or deleted;
- a global or free variable bound to a list / dict / set / deque, an item of
  which is set or deleted or whose mutating method is loaded
  (``LOG.append``);
- a global or free variable whose attribute is set: an object, a class
  (``Counter.calls += 1``: a class attribute) or a module of the user's;
- an argument other than ``ctx`` whose attribute is set, or a local the
  forward returns (``y.tag = v``, not a tensor property such as
  ``y.requires_grad``);
- an argument whose item is set or whose mutating method is loaded, when its
  value in a call is a list / dict / set (``on_arguments``: ``out.append(y)``
  and ``table[k] = v`` count, ``x.add(y)`` and ``x[mask] = 0`` on a tensor do
  not).
A walk that meets a jump target or an instruction whose stack effect it does
not know gives up on that store (no finding): the scan flags what it can
name, and the watch of the runs (side_effects.py) sees the rest.
"""

from __future__ import annotations

import dis
import inspect
import types
from typing import Optional

import torch

from .side_effects import _CONTAINERS, _MISSING, _MUTATORS, user_functions


def static(fn) -> Optional[str]:
    """A side effect the bytecode of the Function's forward shows, or None
    (Note [Forward side effects]); the scan is cached on the OpaqueFunction."""
    return _scanned(fn)[0]


def on_arguments(fn, values) -> Optional[str]:
    """A mutating method the forward's bytecode calls on (or an item it sets in)
    an argument that is a list / dict / set in this call (``out.append(y)``;
    ``x.add(y)`` on a tensor is not one), or None. `values`: the call's
    arguments (example values while tracing)."""
    for name, method in _scanned(fn)[1]:
        i = fn.arg_names.index(name) if name in fn.arg_names else len(values)
        if i < len(values) and isinstance(values[i], _CONTAINERS):
            what = "sets an item of" if method == "__setitem__" else f"calls .{method}() on"
            return f"{what} its argument '{name}' (a {type(values[i]).__name__})"
    return None


def argument_calls(fn) -> tuple:
    """((argument, method), ...): the mutating methods the forward's bytecode
    loads off its arguments (``__setitem__`` for an item set), for ``on_arguments``."""
    return _scanned(fn)[1]


def _scanned(fn) -> tuple:
    """(finding or None, ((argument, method), ...)) of the forward's bytecode."""
    cached = fn.__dict__.get("_static_side_effects")
    if cached is None:
        found, calls = None, []
        for f, has_ctx in user_functions(fn):
            if has_ctx is None:  # a helper the forward calls: its own arguments are locals
                found = _scan(f, f.__code__, set(), set(f.__code__.co_freevars), False, [])
                if found:
                    found = f"calls {f.__qualname__}(), which {found}"
                    break
                continue
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


def _pops_pushes(ins) -> Optional[tuple]:
    """(values popped, values pushed) by `ins`, or None when not known here."""
    op = ins.opname
    try:
        net = dis.stack_effect(ins.opcode, ins.arg, jump=False) if ins.opcode >= dis.HAVE_ARGUMENT \
            else dis.stack_effect(ins.opcode, jump=False)
    except ValueError:
        return None
    if op in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
        return 1, 1 + net
    if op.startswith("LOAD_") or op == "PUSH_NULL":
        return 0, net
    if op.startswith(("STORE_", "DELETE_", "POP_", "RETURN_", "JUMP", "RAISE")) or op in ("NOP", "RESUME"):
        return (None if op.startswith(("JUMP", "POP_JUMP", "RETURN", "RAISE")) else (-net, 0))
    if op.startswith(("BINARY_", "UNARY_", "BUILD_", "CALL", "COMPARE_OP", "CONTAINS_OP",
                      "IS_OP", "FORMAT_VALUE", "GET_ITER", "PRECALL", "KW_NAMES")):
        if op in ("PRECALL", "KW_NAMES"):
            return 0, 0
        return 1 - net, 1
    return None


def _producer(instrs, k, depth):
    """The instruction that pushed the value at `depth` (0: the top) of the
    stack as instrs[k] begins, or None (Note [Every store form])."""
    j = k - 1
    while j >= 0:
        ins = instrs[j]
        if ins.opname == "COPY":
            depth = ins.arg - 1 if depth == 0 else depth - 1
        elif ins.opname == "SWAP":
            n = ins.arg - 1
            depth = n if depth == 0 else 0 if depth == n else depth
        else:
            effect = _pops_pushes(ins)
            if effect is None:
                return None
            pops, pushes = effect
            if depth < pushes:
                return ins
            depth = depth - pushes + pops
        if ins.is_jump_target:
            return None
        j -= 1
    return None


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
            src = _loaded(_producer(instrs, k, 0) or prev, f, params, free)
            if src is not None and isinstance(src[1], _CONTAINERS):
                return f"calls .{ins.argval}() on the {src[0]}"
            if src is not None and src[0].startswith("argument"):
                arg_calls.append((src[0].split("'")[1], ins.argval))
        if op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            target = _producer(instrs, k, 1)
            src = None if target is None else _loaded(target, f, params, free)
            if src is not None and isinstance(src[1], _CONTAINERS):
                what = "sets" if op == "STORE_SUBSCR" else "deletes"
                return f"{what} an item of the {src[0]}"
            if src is not None and src[0].startswith("argument"):
                arg_calls.append((src[0].split("'")[1], "__setitem__"))
        if op in ("STORE_ATTR", "DELETE_ATTR"):
            found = _attribute_store(f, instrs, k, params, free, returned)
            if found:
                return found
    for c in code.co_consts:  # comprehensions, lambdas, inner functions
        if isinstance(c, types.CodeType):
            found = _scan(f, c, set(), free - set(code.co_cellvars), False, arg_calls)
            if found:
                return found
    return None


def _attribute_store(f, instrs, k, params, free, returned) -> Optional[str]:
    """What STORE_ATTR / DELETE_ATTR instrs[k] changes outside the call, or None."""
    attr = instrs[k].argval
    target = _producer(instrs, k, 0)
    if target is None:
        return None
    src = _loaded(target, f, params, free)
    if src is not None:
        value = src[1]
        if isinstance(value, type):
            return f"sets the class attribute .{attr} of the {src[0]}"
        if isinstance(value, types.ModuleType):
            return f"sets the module attribute .{attr} of the {src[0]}"
        whose = "its" if src[0].startswith("argument") else "the"
        return f"sets the attribute .{attr} of {whose} {src[0]}"
    names = target.argval if isinstance(target.argval, tuple) else (target.argval,)
    if (
        target.opname.startswith("LOAD_FAST")
        and names[-1] in returned
        and not hasattr(torch.Tensor, attr)  # y.requires_grad = False
    ):
        return f"sets the Python attribute .{attr} on its output '{names[-1]}'"
    return None
