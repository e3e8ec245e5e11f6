"""Loads self-contained archives and compares them with what the saving
process's eager, stock autograd.Functions computed (values, gradients, None
where eager gave None, the error of a backward that was not stored).

argv: reference file (torch.save: case name -> case dict, see
tests/archive/test_archive_trace_state.py). Prints one JSON object: case name
-> {"ok": true} or {"error": "..."}, plus what of the test package the
process could import."""

import importlib.util, json, sys, warnings
import torch, torch_opaque


def loss_of(outs, weights):
    return sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)


def close(got, want, what):
    if want is None:
        assert got is None, f"{what}: expected None (as eager), got {got}"
        return
    assert got is not None, f"{what}: expected a gradient (as eager), got None"
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def infer(case):
    ep = torch_opaque.load(case["archive"])
    mod = ep.module()
    xs = [x.clone().requires_grad_(rg) for x, rg in zip(case["inputs"], case["requires_grad"])]
    outs = mod(*xs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for k, (o, w) in enumerate(zip(outs, case["out"])):
        close(o, w, f"output {k}")
    if case.get("backward_error"):
        try:
            loss_of(outs, case["loss_weights"]).backward()
        except RuntimeError as e:
            return {"ok": True, "backward_error": str(e)}
        return {"error": "the backward ran; expected it to raise"}
    if case["loss_weights"] is None:
        return {"ok": True}
    loss_of(outs, case["loss_weights"]).backward(create_graph=case.get("create_graph", False))
    for k, (x, g) in enumerate(zip(xs, case["input_grads"])):
        close(x.grad, g, f"gradient of input {k}")
    params = dict(mod.named_parameters())
    for name, g in case["param_grads"].items():
        close(params[name].grad, g, f"gradient of {name}")
    return {"ok": True}


def train(case):
    ep = torch_opaque.load(case["archive"])
    with torch.no_grad():  # as loss.backward() runs a backward
        got = ep.module()(*case["inputs"])
    assert torch_opaque.training_outputs(ep) == case["names"], torch_opaque.training_outputs(ep)
    for name, g, w in zip(case["names"], got, case["want"]):
        close(g, w, name)
    return {"ok": True}


report = {}
for name, case in torch.load(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report[name] = (train if case["kind"] == "train" else infer)(case)
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    report[name]["warnings"] = [str(w.message)[:300] for w in caught]
report["_imported"] = sorted(m for m in sys.modules if m.startswith("opaque_fixtures"))
report["_findable"] = importlib.util.find_spec("opaque_fixtures") is not None
print(json.dumps(report))
