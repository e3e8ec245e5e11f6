"""Loads two archives storing the same op for different kinds of call (and the
first again), runs them, re-saves the second; reports the overloads.

argv: archive a, archive b, path to re-save b to."""

import json, sys
import torch, torch_opaque
a = torch_opaque.load(sys.argv[1])
b = torch_opaque.load(sys.argv[2])
a2 = torch_opaque.load(sys.argv[1])  # the same content: the same overload, nothing new
x32 = torch.randn(6, 3, requires_grad=True)
x64 = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
torch.testing.assert_close(a.module()(x32), x32 ** 3 + 1)
torch.testing.assert_close(b.module()(x64), x64 ** 3 + 1)
torch.testing.assert_close(a2.module()(x32), x32 ** 3 + 1)
b.module()(x64).sum().backward()  # the stored backward (half the true derivative)
torch.testing.assert_close(x64.grad, 1.5 * x64.detach() ** 2)
def ov(ep):
    (t,) = [n.target for n in ep.graph.nodes if "ArchCube" in str(n.target)]
    return t._overloadname
# re-saving a loaded program keeps its stored programs
torch_opaque.save(b, sys.argv[3])
print(json.dumps({"a": ov(a), "b": ov(b), "a2": ov(a2)}))
