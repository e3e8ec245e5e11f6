"""One training step of a round-trip case, and its comparison with eager
(tests/archive/test_archive_roundtrip.py and load_roundtrip_cases.py, which
runs it in the process that loads the archive: it imports nothing of the
tests but this file, beside it).

``step`` calls a model on fresh copies of the inputs (those flagged requiring
grad), takes ``loss`` of the outputs and backpropagates it; the result holds
the outputs, which of them require grad, the loss, and the gradients of the
inputs and parameters (None where autograd gives none)."""

from __future__ import annotations

import torch


def loss(outputs, diff) -> torch.Tensor:
    """sin of each output that requires grad, summed: its cotangent, cos(y),
    differs per element, so a transposed or broadcast gradient shows."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    terms = [o.double().sin().sum() for o, d in zip(outs, diff) if d]
    return torch.stack(terms).sum()


def step(model, args, grad, seed=None, diff=None) -> dict:
    """`diff`: the outputs the loss takes (default: those that require grad)."""
    args = [a.detach().clone().requires_grad_(g) if isinstance(a, torch.Tensor) else a for a, g in zip(args, grad)]
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    if seed is not None:
        torch.manual_seed(seed)
    out = model(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    got_diff = [o.requires_grad for o in outs]
    total = None
    if any(diff if diff is not None else got_diff):
        total = loss(outs, diff if diff is not None else got_diff)
        total.backward()
    return {
        "out": [o.detach() for o in outs],
        "diff": got_diff,
        "loss": None if total is None else total.detach(),
        "grads": [a.grad if isinstance(a, torch.Tensor) and g else None for a, g in zip(args, grad)],
        "param_grads": {n: p.grad for n, p in params.items()},
    }


def close(what: str, got, want, atol: float) -> None:
    if want is None or got is None:
        assert got is None and want is None, f"{what}: {'None' if got is None else 'a tensor'}, eager gives {'None' if want is None else 'a tensor'}"
        return
    torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}")


def compare(got: dict, want: dict, atol: float) -> None:
    """Raises an AssertionError naming the first difference."""
    assert len(got["out"]) == len(want["out"]), f"{len(got['out'])} outputs, eager gives {len(want['out'])}"
    for i, (g, w) in enumerate(zip(got["out"], want["out"])):
        close(f"output {i}", g, w, atol)
    assert got["diff"] == want["diff"], f"outputs requiring grad: {got['diff']}, eager: {want['diff']}"
    for i, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        close(f"gradient of input {i}", g, w, atol)
    assert set(got["param_grads"]) == set(want["param_grads"]), (sorted(got["param_grads"]), sorted(want["param_grads"]))
    for n, w in want["param_grads"].items():
        close(f"gradient of parameter {n}", got["param_grads"][n], w, atol)
