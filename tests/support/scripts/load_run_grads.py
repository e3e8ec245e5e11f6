"""Loads archives, runs each on its reference inputs, compares values and the
custom gradients with the saving process's eager runs (each a batch size); re-saves and reloads
self-contained ones. Reports per case ("ok" or the error) and what was imported.

argv: a JSON file: [{"case", "archive", "loader": "torch_opaque"|"torch", "options", "ref"}]."""

import json, os, sys, tempfile, traceback
import torch

cases = json.load(open(sys.argv[1]))
if any(c["loader"] == "torch" for c in cases):
    import opaque_fixtures.hopops  # noqa: F401  (torch.export.load needs the ops registered)
import torch_opaque


def run(c):
    if c["loader"] == "torch":
        ep = torch.export.load(c["archive"])
    else:
        ep = torch_opaque.load(c["archive"], **c["options"])
    runs = torch.load(c["ref"])["runs"]
    for ref in runs:
        xs = [x.clone().requires_grad_() for x in ref["xs"]]
        y = ep.module()(*xs)
        torch.testing.assert_close(y, ref["y"])
        (y * ref["cotangent"]).sum().backward()
        for i, (x, g) in enumerate(zip(xs, ref["grads"])):
            torch.testing.assert_close(x.grad, g, msg=lambda m: f"gradient of input {i}: {m}")
    if c.get("resave"):
        with tempfile.TemporaryDirectory() as d:
            again = os.path.join(d, "again.pt2")
            torch_opaque.save(ep, again, self_contained=True)
            for ref in runs:
                y2 = torch_opaque.load(again).module()(*ref["xs"])
                torch.testing.assert_close(y2, ref["y"])


out = {}
for c in cases:
    try:
        run(c)
        out[c["case"]] = "ok"
    except Exception as e:
        out[c["case"]] = f"{type(e).__name__}: {e}"[:3000]
        traceback.print_exc()
print(json.dumps({
    "results": out,
    "imported": sorted(m for m in sys.modules if m.startswith("opaque_fixtures")),
}))
