"""Loads the self-contained archive of archops.export_nested(), checks values and
gradients, calls its stored overload with an uncovered kind of argument, reports.

argv: archive."""

import json, sys
import torch, torch_opaque
ep = torch_opaque.load(sys.argv[1])
x = torch.randn(3, 6, requires_grad=True)
y = ep.module()(x)
torch.testing.assert_close(y, (x ** 3 + x).sum(-1))
y.sum().backward()
torch.testing.assert_close(x.grad, 3 * x.detach() ** 2 + 1)
# the graph calls the stored overload (Note [Stored ops beside real ones])
(target,) = [n.target for n in ep.graph.nodes if "ArchOuter" in str(n.target)]
try:
    target(torch.randn(3, 6, dtype=torch.float64))
except RuntimeError as e:
    message = str(e)
print(json.dumps({"message": message, "overload": target._overloadname,
                  "real_free": not hasattr(torch.ops.opaque.ArchOuter, "Tensor"),
                  "imported": [m for m in sys.modules if m.startswith("opaque_fixtures")]}))
