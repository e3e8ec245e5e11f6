"""Loads an archive, compares it with the saving process, trains it, reports.

argv: archive, reference results (torch.save), load options (JSON)."""

import importlib.util, json, sys
import torch
import torch_opaque
from torch_opaque import passes

path, ref_path, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ep = torch_opaque.load(path, **options)
ref = torch.load(ref_path)
mod = ep.module()

# runs: a batch size other than the example's (the batch dimension is dynamic)
torch.testing.assert_close(mod(ref["x"]), ref["y"])
# the custom backward (ArchCube's is deliberately half the true derivative)
x = ref["x"].clone().requires_grad_()
mod(x).sum().backward()
torch.testing.assert_close(x.grad, ref["x_grad"])
for name, p in mod.named_parameters():
    torch.testing.assert_close(p.grad, ref["param_grads"][name])

# the loaded program exports again and decomposes (fake kernels work)
batch = torch.export.Dim("batch", min=2)
again = torch.export.export(ep.module(), (ref["x"],), dynamic_shapes=({0: batch},))
torch.testing.assert_close(again.module()(ref["x"][:3]), ep.module()(ref["x"][:3]))
dec = ep.run_decompositions()
torch.testing.assert_close(dec.module()(ref["x"]), ref["y"])
inlined = passes.inline(ep)
assert passes.list_opaque_ops(inlined) == []
torch.testing.assert_close(inlined.module()(ref["x"]), ref["y"])

# trains (last: the module shares its weights with ep)
torch.manual_seed(0)
target = torch.randn_like(ref["y"])
opt = torch.optim.SGD(mod.parameters(), lr=0.05)
losses = []
for _ in range(15):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(mod(ref["x"]), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
assert losses[-1] < 0.8 * losses[0], losses

print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.startswith("opaque_fixtures")),
    "findable": importlib.util.find_spec("opaque_fixtures") is not None,
    "ops": [r.qualified_name for r in passes.list_opaque_ops(ep)],
    # the overloads the program calls (stored programs: "<overload>_stored_<digest>")
    "overloads": sorted({n.target._overloadname for n in ep.graph.nodes
                         if isinstance(n.target, torch._ops.OpOverload)
                         and n.target.namespace not in ("aten", "prims")}),
}))
