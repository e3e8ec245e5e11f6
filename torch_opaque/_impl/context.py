"""The ``ctx`` objects handed to a wrapped Function's forward and backward.

They behave like ``torch.autograd.function.FunctionCtx`` for everything an
opaque op can carry, and say clearly what it cannot.

Note [Context state]
Whatever the forward leaves on ctx must reach the backward through the
``_bwd`` op's schema, so that a traced training graph carries it:
- tensors passed to ``save_for_backward`` (and tensors stored as attributes)
  become saved tensors: inputs and outputs by reference, anything else as a
  residual output of the ``_fwd`` op;
- other attributes are encoded into the ``str state`` argument as a Python
  literal; symbolic ints (``x.shape[0]`` under dynamic shapes) go to the
  ``SymInt[] state_ints`` argument and are referenced from the literal.
Values that have no such representation are refused with an error naming the
attribute.

Eager calls skip all of this: the ctx attribute dict itself goes to the
backward (Note [Eager context state] in include/torch_opaque/forward_record.h),
so the backward sees exactly the objects the forward stored, as with stock
autograd.Function. The encoding runs only when a graph is traced (the fake
forward, or a backward that is itself being traced), and only then can a value
be refused.
"""

from __future__ import annotations

import ast

import torch

from .._native import _C
from ..errors import UnsupportedError

# Note [ctx types] (csrc/python/context_types.h): both are C types, like
# autograd.Function's own ctx. ForwardContext(fn_name, needs_input_grad) has
# save_for_backward / saved_tensors, needs_input_grad, mark_non_differentiable,
# set_materialize_grads, save_for_forward (ignored), and refuses mark_dirty
# (in-place Functions shadow it per call: Note [In-place Functions], in_place.py);
# BackwardContext(fn_name, saved_tensors, needs_input_grad, attrs) has
# saved_tensors (saved_variables), needs_input_grad and the forward's attributes.
# Their __dict__ holds exactly the user's attributes.
ForwardContext = _C.ForwardContext
BackwardContext = _C.BackwardContext


def user_attributes(ctx: ForwardContext) -> dict:
    return ctx.__dict__


# ---- encoding non-tensor state -------------------------------------------------
#
# The literal is a tuple of (name, encoded value) pairs. Encoded values are
# plain literals, or tagged tuples for what literal_eval cannot read:
#   ("T", i)   saved tensor i          ("S", i)  state_ints[i]
#   ("D", "float32") dtype             ("V", "cpu") device
#   ("Z", (...)) torch.Size            ("L", (...)) list  ("U", (...)) tuple


class _Encoder:
    def __init__(self, fn_name, saved: list, ints: list):
        self.fn_name = fn_name
        self.saved = saved
        self.ints = ints

    def __call__(self, name, v):
        v = self._plain(name, v)
        if v is None or isinstance(v, (bool, int, float, str)):
            if isinstance(v, float) and v != v:
                return ("F", "nan")
            if isinstance(v, float) and v in (float("inf"), float("-inf")):
                return ("F", repr(v))
            return v
        if isinstance(v, torch.SymInt):
            self.ints.append(v)
            return ("S", len(self.ints) - 1)
        if isinstance(v, torch.Tensor):
            self.saved.append(v)
            return ("T", len(self.saved) - 1)
        if isinstance(v, torch.dtype):
            return ("D", str(v).replace("torch.", ""))
        if isinstance(v, torch.device):
            return ("V", str(v))
        if isinstance(v, torch.Size):
            return ("Z", tuple(self(name, x) for x in v))
        if type(v) in (list, tuple):
            items = tuple(self(name, x) for x in v)
            if any(isinstance(x, tuple) and x and x[0] == "T" for x in items):
                raise UnsupportedError(
                    f"torch_opaque: {self.fn_name}: ctx.{name} holds tensors inside a "
                    f"{type(v).__name__}, which a traced graph cannot carry to the backward "
                    f"op; save them with ctx.save_for_backward(...) instead."
                )
            return ("L" if isinstance(v, list) else "U", items)
        raise UnsupportedError(
            f"torch_opaque: {self.fn_name}: ctx.{name} holds a {type(v).__name__}, which a "
            f"traced graph cannot carry to the backward op (eager calls keep it as it is). "
            f"Keep tensors in ctx.save_for_backward(...) and other state as int, float, "
            f"bool, str, None, torch.dtype, torch.device, torch.Size or plain lists/tuples "
            f"of those, or keep this Function unwrapped."
        )

    @staticmethod
    def _plain(name, v):
        """Numbers and strings of other types (numpy scalars, IntEnum, float or
        str subclasses) as the plain Python value they stand for: a traced
        graph holds them as constants."""
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t.__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            return v.item()
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, int) and not isinstance(v, torch.SymInt):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, str):
            return str(v)
        return v


def encode_state(fn_name: str, attrs: dict, saved: list) -> tuple:
    """(state string, state ints); tensors in attrs are appended to `saved`.

    The literal is ``(number of explicitly saved tensors, pairs)``.
    """
    if not attrs:
        return "", []
    n_explicit = len(saved)
    ints: list = []
    enc = _Encoder(fn_name, saved, ints)
    pairs = tuple((k, enc(k, v)) for k, v in attrs.items())
    return repr((n_explicit, pairs)), ints


_DECODE_CACHE: dict = {}


def _bad_state(what: str) -> UnsupportedError:
    # A state string comes from a graph, and a graph may come from a file: it
    # decodes to plain values only (Note [Context state]).
    return UnsupportedError(
        f"torch_opaque: invalid ctx state in the graph ({what}); the state argument of an "
        "opaque op must be written by torch_opaque (export the program again)")


def _decode(v, saved, ints):
    if isinstance(v, tuple):
        tag, body = v
        if tag == "T":
            return saved[body]
        if tag == "S":
            return ints[body]
        if tag == "D":
            dtype = getattr(torch, body, None) if isinstance(body, str) else None
            if not isinstance(dtype, torch.dtype):
                raise _bad_state(f"{body!r} is not a dtype name")
            return dtype
        if tag == "V":
            return torch.device(body)
        if tag == "F":
            return float(body)
        if tag not in ("Z", "L", "U") or not isinstance(body, tuple):
            raise _bad_state(f"unknown entry {v!r}")
        items = [_decode(x, saved, ints) for x in body]
        if tag == "Z":
            return torch.Size(items)
        return items if tag == "L" else tuple(items)
    return v


def parsed_state(state: str) -> tuple:
    """(number of explicitly saved tensors, encoded attribute pairs) of encode_state's string."""
    parsed = _DECODE_CACHE.get(state)
    if parsed is None:
        parsed = ast.literal_eval(state)
        if len(_DECODE_CACHE) > 4096:
            _DECODE_CACHE.clear()
        _DECODE_CACHE[state] = parsed
    return parsed


def decode_state(state: str, saved, ints) -> tuple:
    """(number of explicitly saved tensors, attributes) from encode_state's string."""
    n_explicit, pairs = parsed_state(state)
    return n_explicit, {k: _decode(v, saved, ints) for k, v in pairs}
