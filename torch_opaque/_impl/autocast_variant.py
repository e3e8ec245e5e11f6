"""The autocast state a call was made under, kept in the call (Note [Autocast in
the call]): the state string, and each op family's autocast variant, which
the Autocast kernels of integrations/autocast.py call.

Note [Autocast in the call]
A stock Function under ``torch.autocast`` runs its forward with autocast on:
each op of the body casts as autocast says (``x @ w`` gives bfloat16 under
``torch.autocast("cpu", torch.bfloat16)``; a ``custom_fwd(cast_inputs=...)``
forward casts its inputs and turns autocast off). An op's kernel runs where its
call runs: in eager code that is inside the autocast block, but a traced
program (``run_decompositions``, ``ep.module()`` after it, ``torch.compile``)
applies autocast while it is traced and runs without it, so the kernel would
run the body in its inputs' dtypes. So the state goes into the call:

* every overload of a Function gets a kernel at the Autocast keys (CPU, CUDA,
  and the other devices autocast knows: integrations/autocast.py). It runs only while autocast is on for
  a device of the call's tensors (at run time in eager code; at trace time in
  traced code, where the autocast block is entered while tracing), and calls
  the Function's *autocast variant* ``ns::Name_autocast`` with the call's
  arguments and one more, the state as a string (``"cpu:torch.bfloat16"``,
  ``;``-separated for several devices). The variant is its own opaque op
  family (``_fwd``, ``_bwd``, fakes: everything an op has), defined from a
  subclass of the Function whose forward enters that autocast state around the
  user's forward and whose backward drops the state's gradient. Traced graphs
  hold the variant's node, state included: one opaque node per call still, and
  the dtypes of stock eager code everywhere.
* the backward runs as stock's does: without autocast, unless the user's
  backward is decorated with ``custom_bwd`` (which re-enters the forward's
  state from ctx).
* the variant's ops have no Autocast kernel; ``torch.func`` transforms
  (``jvp``/``vmap`` rules) are not carried over (autocast with them runs the
  op's own kernels).
* in-place Functions (``ctx.mark_dirty``) get an in-place variant: it writes
  into the same arguments, and the Autocast kernel returns the op's other
  outputs, as the op does (Note [In-place Functions]).
* ops defined in C++ (``TORCH_OPAQUE_DEF``) get the same from the C++ core:
  a variant family and Autocast kernels defined with the op (Note [Autocast
  in the call: C++ ops] in csrc/autocast_variant.cpp), the same state string.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch

from . import registry
from .opaque_function import OpaqueFunction

STATE_ARG = "autocast_state"
SUFFIX = "_autocast"
QUALNAME_PART = "<autocast>"  # the variant class's qualname: <base qualname>.<autocast>


def _autocast_keys() -> dict:
    """device type -> its Autocast dispatch key name, for the devices autocast knows."""
    keys = {}
    devices = ["cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "ipu", "xla", "privateuseone"]
    devices.append(torch._C._get_privateuse1_backend_name())  # as csrc/autocast_variant.cpp names it
    for device_type in dict.fromkeys(devices):
        try:
            if not torch._C._is_autocast_available(device_type):
                continue
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        except (RuntimeError, AttributeError):
            continue
        if hasattr(torch._C.DispatchKey, key):
            keys[device_type] = key
    return keys


_KEYS = _autocast_keys()


def call_state(args) -> Optional[str]:
    """The enabled autocast for the devices of the call's tensors, as the
    variant's string argument, or None."""
    devices = set()
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                devices.add(t.device.type)
    parts = [
        f"{d}:{torch.get_autocast_dtype(d)}"
        for d in sorted(devices)
        if d in _KEYS and torch.is_autocast_enabled(d)
    ]
    return ";".join(parts) or None


@contextlib.contextmanager
def entered(state: str):
    """Enter the autocast state a call recorded."""
    with contextlib.ExitStack() as stack:
        for part in filter(None, state.split(";")):
            device_type, _, dtype_name = part.partition(":")
            dtype = getattr(torch, dtype_name.replace("torch.", ""), None)
            if device_type not in _KEYS or not isinstance(dtype, torch.dtype):
                raise ValueError(
                    f"torch_opaque: autocast state {state!r} of an autocast variant call is not "
                    f"'<device type>:<dtype>' of a device autocast knows (as in "
                    f"'cpu:torch.bfloat16', ';'-separated). Pass the state the op's Autocast "
                    f"kernel records, or call the op without the '{SUFFIX}' suffix under "
                    f"torch.autocast."
                )
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def variant_class(cls: type, setup_style: bool) -> type:
    """A subclass of ``cls`` whose forward takes the state last and runs the
    user's forward under it; its backward adds the state's (None) gradient."""
    user_forward, user_backward = cls.forward, cls.backward
    params = list(inspect.signature(user_forward).parameters.values())
    state = inspect.Parameter(STATE_ARG, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default="", annotation=str)

    if setup_style:
        def forward(*args):
            *args, state_value = args
            with entered(state_value):
                return user_forward(*args)

        user_setup = cls.setup_context

        def setup_context(ctx, inputs, output):
            return user_setup(ctx, tuple(inputs)[:-1], output)
    else:
        def forward(ctx, *args):
            *args, state_value = args
            with entered(state_value):
                return user_forward(ctx, *args)

        setup_context = None

    forward.__signature__ = inspect.Signature(params + [state])

    def backward(ctx, *grads):
        out = user_backward(ctx, *grads)
        return (*(out if isinstance(out, tuple) else (out,)), None)

    body = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "jvp": torch.autograd.Function.jvp,
        "vmap": torch.autograd.Function.vmap,
        "generate_vmap_rule": False,
        "__module__": cls.__module__,
        # archives name the variant by its base class (archive/loading.py)
        "__qualname__": f"{cls.__qualname__}.{QUALNAME_PART}",
    }
    if setup_context is not None:
        body["setup_context"] = staticmethod(setup_context)
    user_fake = getattr(cls, "fake", None)
    if user_fake is not None:
        def fake(*args):
            *args, state_value = args
            with entered(state_value):
                return user_fake(*args)

        fake.__signature__ = forward.__signature__
        body["fake"] = staticmethod(fake)
    return type(cls.__name__, (cls,), body)


def variant_of(fn):
    """The OpaqueFunction of ``fn``'s autocast variant, defined on first use."""
    variant = getattr(fn, "autocast_variant", None)
    if variant is None:
        cls = variant_class(fn.cls, fn.setup_style)  # (class creation: outside the lock)
        with registry._LOCK:  # two threads' first calls define one variant
            variant = getattr(fn, "autocast_variant", None)
            if variant is None:
                variant = define_autocast_variant(fn, cls, fn.name + SUFFIX)
                fn.autocast_variant = variant
    return variant


def define_autocast_variant(fn, variant_cls: type, name: str):
    """The op family of ``fn``'s autocast variant: ``variant_cls`` wrapped as
    ``name`` (or a free name after it), its class kept alive by the variant,
    which ``fn`` keeps."""
    with registry._LOCK:
        op_name = registry._free_name(fn.namespace, name)
        variant = OpaqueFunction(variant_cls, fn.namespace, op_name, explicit=True)
        variant.autocast_base = fn
        # its forward wraps the user's, which marks the arguments dirty
        variant.dirty, variant.dirty_pairs = fn.dirty, fn.dirty_pairs
        variant.autocast_class = variant_cls
        registry.add(variant)
    return variant


def variant_from_archive(base_fn, namespace: str, name: str):
    """The variant an archive calls ``namespace::name``, defined for the base
    class's OpaqueFunction; None when the base's variant would have another name."""
    variant = variant_of(base_fn)
    return variant if (variant.namespace, variant.name) == (namespace, name) else None
