"""``torch.fx.symbolic_trace`` of code that calls a wrapped Function.

Note [FX symbolic tracing]
``torch.fx.symbolic_trace`` runs a module's forward on ``torch.fx.Proxy``
objects. A stock Function's ``apply`` hands them to the forward, so the
GraphModule holds the forward's operations and autograd differentiates those:
a straight-through estimator's custom backward is lost (``round``'s gradient
is zeros). A wrapped class (or, inside ``auto()``, an eligible one) instead
records one ``call_function`` node of its op's overload
(``torch.ops.<ns>.<Name>.<overload>``), followed by ``getitem`` nodes for
several outputs, so the GraphModule runs the op, with the custom backward.

No patch of torch.fx is needed: a Proxy argument never matches a defined
overload, so the call reaches ``OpaqueFunction.apply``'s first-call path (and
``auto.call``'s), which asks :func:`traced_by_fx` first. The schema then comes
from what each argument is:

- a Proxy stands for a Tensor (FX records no types: a tensor is what a
  Function's argument almost always is), and a list/tuple of Proxies for a
  ``Tensor[]``;
- other values (float, int, bool, None, tuples of ints...) are the Python
  values the graph records as constants, typed as an eager call types them;
- a Proxy for a value that is plainly no tensor (``x.shape[0]``, ``x.size(1)``,
  ``x.dim()``, ``len(x)``, arithmetic on those) can be an op argument only
  where forward's annotation says what it is (``n: int``): the node passes it
  on and the GraphModule calls the op with the int. Without that annotation
  there is no schema type to give it, and the call is refused with an error
  that says so (an annotation, ``concrete_args``, or torch.export, which sees
  sizes as SymInts).

The overload is the one an eager call of the same kinds of arguments uses
(defined already, or defined here with the same name). Defining it needs the
number of outputs: from the return annotation, else by running the forward
on fresh Proxies of a scratch graph (no shapes exist under symbolic tracing,
so a fake run is not possible); a forward that cannot be traced that way gets
an error asking for a return annotation or one eager call first. In-place
Functions (``ctx.mark_dirty``) are refused: their results are arguments,
which a node of a functional op cannot express here. Under ``auto()`` each of
these failures falls back to the ordinary Function (which symbolic_trace
inlines), with auto's warning (Note [Auto fall-back]).
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, Optional

import torch
import torch.fx

from ..errors import SchemaError, UnsupportedError

_Proxy = torch.fx.Proxy

# Reading these from a tensor gives no tensor (``x.shape``, ``x.size(0)``...).
_NON_TENSOR_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"}
_NON_TENSOR_METHODS = {"size", "dim", "numel", "nelement", "item", "tolist", "stride",
                       "element_size", "ndimension", "get_device", "is_contiguous"}
_SCALAR_FUNCTIONS = {builtins.len, builtins.int, builtins.float, builtins.bool}
_OPERATORS = {getattr(operator, n) for n in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")}


def _is_proxy(v) -> bool:
    return isinstance(v, _Proxy)


def traced_by_fx(values) -> bool:
    """Whether a call's arguments hold torch.fx Proxies (symbolic tracing)."""
    for v in values:
        if isinstance(v, _Proxy):
            return True
        if type(v) in (list, tuple) and any(isinstance(x, _Proxy) for x in v):
            return True
    return False


traces = traced_by_fx  # the ``tracers`` extension point asks ``traces`` and ``call``


def _non_tensor(node: torch.fx.Node) -> bool:
    """Whether the graph shows that ``node`` produces something other than a
    tensor (a size, a dim, a Python number computed from them)."""
    if node.op == "placeholder":
        return node.type is not None and node.type not in (torch.Tensor, torch.nn.Parameter)
    if node.op == "call_method":
        return node.target in _NON_TENSOR_METHODS
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _NON_TENSOR_ATTRS
    if node.target in _SCALAR_FUNCTIONS:
        return True
    if node.target in _OPERATORS:
        nodes = [a for a in node.args if isinstance(a, torch.fx.Node)]
        return bool(nodes) and all(_non_tensor(a) for a in nodes)
    return False


def _describe(a, depth: int = 0) -> str:
    """``x.shape[0]`` for the node of that expression (for messages)."""
    if not isinstance(a, torch.fx.Node):
        return repr(a)
    if depth > 4:
        return a.name
    args = [_describe(x, depth + 1) for x in a.args]
    if a.op == "call_function" and a.target is builtins.getattr and len(args) == 2:
        return f"{args[0]}.{a.args[1]}"
    if a.op == "call_function" and a.target is operator.getitem and len(args) == 2:
        return f"{args[0]}[{args[1]}]"
    if a.op == "call_method" and args:
        return f"{args[0]}.{a.target}({', '.join(args[1:])})"
    if a.op == "call_function":
        return f"{getattr(a.target, '__name__', a.target)}({', '.join(args)})"
    return a.name


_STAND_INS = {"SymInt": 1, "float": 1.0, "bool": True, "str": "", "ScalarType": torch.float32,
              "Device": torch.device("cpu")}


def _stand_ins(fn, values) -> list:
    """Values of the kinds the arguments stand for, to pick (or define) the
    overload: an empty tensor for a tensor Proxy, a value of the annotated
    type for a Proxy of a non-tensor annotated argument."""
    names = fn.arg_names if not fn.varargs else [f"arg{i}" for i in range(len(values))]
    hints = fn.hint_specs if fn.hint_specs is not None and len(fn.hint_specs) == len(values) else None
    out = []
    for i, v in enumerate(values):
        if type(v) in (list, tuple) and any(_is_proxy(x) for x in v):
            out.append(type(v)(torch.empty(0) if _is_proxy(x) else x for x in v))
            continue
        if not _is_proxy(v):
            out.append(v)
            continue
        typ = hints[i].type.rstrip("?") if hints is not None else None
        if typ is not None and typ != "Tensor":
            if typ not in _STAND_INS:
                raise SchemaError(
                    f"torch_opaque: {fn.display_name}.apply: argument '{names[i]}' (annotated "
                    f"{typ}) is a torch.fx Proxy while symbolic_trace records the call, and an "
                    f"op argument of that type cannot come from the graph. Pass a Python value "
                    f"(symbolic_trace's concrete_args), or trace with torch.export."
                )
            out.append(_STAND_INS[typ])
            continue
        if typ is None and _non_tensor(v.node):
            raise SchemaError(
                f"torch_opaque: {fn.display_name}.apply: argument '{names[i]}' is a torch.fx Proxy "
                f"for a value that is not a tensor ({_describe(v.node)}); "
                f"symbolic_trace does not record what it is, so the op's schema cannot type it. "
                f"Annotate forward's argument (e.g. '{names[i]}: int'), so that the op takes it "
                f"as that type, or pass a Python value (symbolic_trace's concrete_args), or "
                f"trace with torch.export, which sees sizes as SymInts."
            )
        out.append(torch.empty(0))
    return out


class _ScratchCtx:
    """The ctx of a forward run on scratch Proxies: accepts what forward does."""

    def __init__(self, n: int):
        self.needs_input_grad = (True,) * n
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.to_save = tensors

    def mark_non_differentiable(self, *args):
        pass

    def mark_dirty(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass

    def save_for_forward(self, *tensors):
        pass


def _output_structure(fn, values) -> tuple:
    """(number of outputs, returns a tuple), from the return annotation or by
    tracing forward on Proxies of a scratch graph."""
    if fn.returns_hint is not None:
        return fn.returns_hint
    tracer = torch.fx.Tracer()
    tracer.graph = torch.fx.Graph(tracer_cls=type(tracer))
    tracer.root = torch.nn.Module()
    tracer.tensor_attrs = {}
    k = iter(range(10**6))

    def fresh(v):
        if _is_proxy(v):
            return tracer.create_proxy("placeholder", f"arg{next(k)}", (), {})
        if type(v) in (list, tuple):
            return type(v)(fresh(x) for x in v)
        return v

    args = [fresh(v) for v in values]
    try:
        if fn.setup_style:
            out = fn.cls.forward(*args)
        else:
            out = fn.cls.forward(_ScratchCtx(len(args)), *args)
    except Exception as e:
        raise SchemaError(
            f"torch_opaque: {fn.display_name}: cannot tell how many tensors its forward returns "
            f"while torch.fx.symbolic_trace records the call (running forward on Proxies failed: "
            f"{type(e).__name__}: {e}). Annotate forward's return (-> torch.Tensor, or "
            f"-> tuple[torch.Tensor, torch.Tensor]), or call {fn.display_name}.apply once "
            f"eagerly with arguments of the same kinds before tracing."
        ) from e
    outs = out if isinstance(out, tuple) else (out,)
    bad = [type(o).__name__ for o in outs if not isinstance(o, (_Proxy, torch.Tensor))]
    if bad or not outs:
        raise SchemaError(
            f"torch_opaque: {fn.display_name}: its forward, traced by torch.fx, returned "
            f"{bad or 'nothing'} where an op returns tensors. Return tensors (or a tuple of them)."
        )
    return len(outs), isinstance(out, tuple)


def _overload(fn, values):
    """The overload the call uses: the one eager calls of these kinds use,
    defined here if no call defined it yet."""
    from .._impl.schema import specs_for_call

    if fn.dirty:
        raise UnsupportedError(
            f"torch_opaque: {fn.display_name} modifies its arguments in place (ctx.mark_dirty); "
            f"torch.fx.symbolic_trace cannot record it as one op node. Trace with torch.export "
            f"(which keeps it as the op), or leave it unwrapped."
        )
    stand_ins = _stand_ins(fn, values)
    ov = fn.defined_overload(stand_ins)
    if ov is not None and ov.claimed_by is None:
        return ov
    names = fn.arg_names if not fn.varargs else [f"arg{i}" for i in range(len(values))]
    specs, name = specs_for_call(fn.hint_specs, names, stand_ins, fn.defaults, fn.display_name)
    existing = fn.overloads.get(name or "default")
    if existing is not None and existing.claimed_by is None:
        return fn.define_overload(name, specs, existing.n_out, existing.returns_tuple, stand_ins)
    n_out, returns_tuple = _output_structure(fn, values)
    return fn.define_overload(name, specs, n_out, returns_tuple, stand_ins)


def call(fn, values: list) -> Any:
    """Record ``fn``'s op for these arguments (some of them Proxies) as one node
    of the graph being traced (Note [FX symbolic tracing])."""
    ov = _overload(fn, values)
    tracer = _tracer(values)
    out = tracer.create_proxy("call_function", ov.op, tuple(values), {})
    if ov.n_out > 1:
        return tuple(out[i] for i in range(ov.n_out))
    return (out,) if ov.returns_tuple else out


def _tracer(values) -> Optional[torch.fx.Tracer]:
    for v in values:
        for x in (v if type(v) in (list, tuple) else (v,)):
            if _is_proxy(x):
                return x.tracer
    return None  # pragma: no cover - only called when traced_by_fx
