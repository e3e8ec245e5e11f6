"""One forward/backward step under torch.autocast, and the comparison of two
steps' results, for the autocast tests (Python Functions and C++ ops)."""

import torch


def step(model, x, run=None):
    """Output and gradients (input, weight) of one forward/backward, autocast
    entered around the call when the model does not enter it itself
    (``model.inside``)."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not model.inside):
        out = (run if run is not None else model)(x)
    out.float().sum().backward()
    return out, x.grad, model.w.grad


def assert_same(got, want):
    """Same dtypes, values within bfloat16's precision; None where ``want`` has None."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
