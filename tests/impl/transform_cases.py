"""Helpers comparing torch.func / autograd transforms of a wrapped Function with
the same Function unwrapped (the reference), over PyTorch's autograd.Function corpus
(torch.testing._internal.autograd_function_db)."""

import pytest
import torch

from test_autograd_function_db import ENTRIES, samples, wrapped_copy

# Entries that are not ops under torch_opaque (in-place; numpy output): see
# test_autograd_function_db.py.
SKIP = {"NumpyExpMarkDirtyAutogradFunction", "NumpyCubeNotComposableAutogradFunction"}
NAMES = sorted(n for n in ENTRIES if n not in SKIP)

_wrapped: dict = {}


def pair(name):
    """(stock callable, wrapped callable, [(args, kwargs)])."""
    entry = ENTRIES[name]
    if name not in _wrapped:
        _wrapped[name] = wrapped_copy(entry)[1]
    return entry.op, _wrapped[name], samples(entry)


def float_fn(fn, args, kwargs):
    """g(*floating tensor inputs) -> tuple of the floating outputs of fn (other
    arguments fixed)."""
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def g(*tensors):
        full = list(args)
        for i, t in zip(pos, tensors):
            full[i] = t
        out = fn(*full, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o for o in out if o.is_floating_point())

    return g, tuple(args[i].detach() for i in pos)


def each_case(name):
    """(stock g, wrapped g, floating tensor inputs) per sample of the entry (float_fn)."""
    stock, ours, cases = pair(name)
    for args, kwargs in cases:
        g_ref, ts = float_fn(stock, args, kwargs)
        yield g_ref, float_fn(ours, args, kwargs)[0], ts


def vmap_batch(ts):
    """(a batch of three samples of the first input, in_dims batching only it)."""
    batch = torch.stack([ts[0], ts[0] * 0.5 + 1.0, -ts[0]])
    return batch, (0,) + (None,) * (len(ts) - 1)


def compare(stock_thunk, ours_thunk):
    """Both give equal results, or both raise the same kind of error."""
    try:
        ref = stock_thunk()
    except Exception as e:  # noqa: BLE001 - the reference decides what is expected
        with pytest.raises(type(e)):
            ours_thunk()
        return
    torch.testing.assert_close(ours_thunk(), ref)
