"""Ops re-created from self-contained archives live beside the real ones
(Note [Stored ops beside real ones] in torch_opaque/archive/stored.py)."""

import json

import pytest
import torch

import torch_opaque
from opaque_fixtures import archops
from test_archive import last_json, run_script


class CubeModel(torch.nn.Module):
    def forward(self, x):
        return archops.Cube.apply(x) + 1


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    d = tmp_path_factory.mktemp("stored")
    torch_opaque.save(archops.export_net(), d / "net_sc.pt2", self_contained=True)
    # the same op for two other kinds of call: float32 [*, 3] and float64 [2, 5]
    batch = torch.export.Dim("batch")
    ep32 = torch.export.export(CubeModel(), (torch.randn(4, 3),), dynamic_shapes=({0: batch},))
    ep64 = torch.export.export(CubeModel(), (torch.randn(2, 5, dtype=torch.float64),))
    torch_opaque.save(ep32, d / "cube32.pt2", self_contained=True)
    torch_opaque.save(ep64, d / "cube64.pt2", self_contained=True)
    return d


REAL_AFTER_STORED = """
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
"""


def test_real_function_after_a_stored_load(archives, tmp_path):
    proc = run_script(REAL_AFTER_STORED, [archives / "net_sc.pt2"], tmp_path, with_fixtures=True)
    out = last_json(proc)
    assert all("_stored_" in o for o in out["stored"]) and len(out["stored"]) == 3
    assert out["again"] == ["Tensor", "Tensor_Tensor", "Tensor_float"]
    assert out["same"]


TWO_ARCHIVES = """
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
"""

RELOAD = """
import json, sys
import torch, torch_opaque
ep = torch_opaque.load(sys.argv[1])
x64 = torch.randn(2, 5, dtype=torch.float64)
torch.testing.assert_close(ep.module()(x64), x64 ** 3 + 1)
(t,) = [n.target for n in ep.graph.nodes if "ArchCube" in str(n.target)]
print(json.dumps({"overload": t._overloadname}))
"""


def test_archives_storing_the_same_op_for_different_calls(archives, tmp_path):
    resaved = tmp_path / "resaved.pt2"
    out = last_json(
        run_script(TWO_ARCHIVES, [archives / "cube32.pt2", archives / "cube64.pt2", resaved],
                   tmp_path, with_fixtures=False)
    )  # fmt: skip
    assert out["a"] != out["b"] and out["a"] == out["a2"]
    assert out["a"].startswith("Tensor_stored_") and out["b"].startswith("Tensor_stored_")
    again = last_json(run_script(RELOAD, [resaved], tmp_path, with_fixtures=False))
    assert again["overload"] == out["b"]  # the suffix is replaced, not stacked


TWICE = """
import json, sys
import torch_opaque
out = []
for _ in range(2):
    try:
        torch_opaque.load(sys.argv[1])
        out.append("loaded")
    except torch_opaque.ArchiveError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def test_a_stored_program_that_fails_to_read_fails_every_time(archives, tmp_path):
    """The op is defined before its programs are read; a second load of the same
    (corrupted) archive must not find it half made and succeed."""
    import archive_corpus as C

    bad = tmp_path / "bad.pt2"
    C.rewrite(archives / "cube32.pt2", bad,
              lambda n, b: b[: len(b) // 2] + b"A" * (len(b) - len(b) // 2) if n.endswith(".fwd") else b)  # fmt: skip
    proc = run_script(TWICE, [bad], tmp_path, with_fixtures=False)
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "the stored fwd program of opaque::ArchCube.Tensor" in first
    assert second == first
