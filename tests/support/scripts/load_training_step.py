"""Loads a saved training step (torch_opaque.export_training), compares its loss
and gradients with the saving process's eager autograd at two batch sizes,
saves and loads it again, runs a few SGD steps (the loss falls), and reports
the fixture modules imported and the Name_bwd overloads the graph calls.

argv: archive, reference results, load options (JSON)."""

import json, sys
import torch, torch_opaque
path, ref_path, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ep = torch_opaque.load(path, **options)
ref = torch.load(ref_path)
assert torch_opaque.training_outputs(ep) == ref["names"], torch_opaque.training_outputs(ep)
for x, want in zip(ref["xs"], ref["want"]):      # two batch sizes: the batch stays dynamic
    got = ep.module()(x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
# saved again (stored programs are kept) and loaded again: the same results
torch_opaque.save(ep, "again.pt2")
again = torch_opaque.load("again.pt2", **options)
for g, w in zip(again.module()(ref["xs"][1]), ref["want"][1]):
    torch.testing.assert_close(g, w)
# a few SGD steps on the program's own parameters: the loss falls
mod = ep.module()
params = dict(mod.named_parameters())
x = ref["xs"][0]
losses = []
for _ in range(8):
    loss, *grads = mod(x)
    losses.append(loss.item())
    with torch.no_grad():
        for n, g in zip(ref["names"][1:], grads):
            params[n].sub_(0.2 * g)
assert losses[-1] < losses[0], losses
print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.startswith("opaque_fixtures")),
    "bwd_overloads": sorted({str(n.target) for n in ep.graph.nodes if "_bwd" in str(n.target)}),
}))
