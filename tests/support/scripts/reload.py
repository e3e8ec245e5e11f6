"""Loads a re-saved archive, runs it, reports the overload it calls.

argv: archive."""

import json, sys
import torch, torch_opaque
ep = torch_opaque.load(sys.argv[1])
x64 = torch.randn(2, 5, dtype=torch.float64)
torch.testing.assert_close(ep.module()(x64), x64 ** 3 + 1)
(t,) = [n.target for n in ep.graph.nodes if "ArchCube" in str(n.target)]
print(json.dumps({"overload": t._overloadname}))
