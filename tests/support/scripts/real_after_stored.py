"""Loads a self-contained archive, then imports and calls the real Functions:
both run side by side; loading again uses the real ops.

argv: archive."""

import json, sys
import torch, torch_opaque
path = sys.argv[1]
x = torch.randn(7, 6)
stored_ep = torch_opaque.load(path)
y_stored = stored_ep.module()(x)
overloads = sorted({n.target._overloadname for n in stored_ep.graph.nodes
                    if n.op == "call_function" and "Arch" in str(n.target)})
# the real Functions: importing and calling them defines their own overloads
from opaque_fixtures import archops
net = archops.Net()
y_real = net(x)
# the real op runs the Function (Cube's backward is half the true derivative)
xr = x[:, :4].clone().requires_grad_()
archops.Cube.apply(xr).sum().backward()
torch.testing.assert_close(xr.grad, 1.5 * xr.detach() ** 2)
# the program loaded before still runs its stored programs
torch.testing.assert_close(stored_ep.module()(x), y_stored)
# loading again now uses the real ops (nothing stored is needed)
again = torch_opaque.load(path)
again_overloads = sorted({n.target._overloadname for n in again.graph.nodes
                          if n.op == "call_function" and "Arch" in str(n.target)})
torch.testing.assert_close(again.module()(x), y_stored)
print(json.dumps({"stored": overloads, "again": again_overloads,
                  "same": bool(torch.allclose(y_stored, y_real, atol=1e-5))}))
