"""Ops re-created from self-contained archives live beside the real ones
(Note [Stored ops beside real ones] in torch_opaque/archive/stored.py)."""

import json

import pytest
import torch

import torch_opaque
from opaque_fixtures import archops
from support.processes import last_json, run_script


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


def test_real_function_after_a_stored_load(archives, tmp_path):
    proc = run_script("real_after_stored.py", [archives / "net_sc.pt2"], tmp_path, with_fixtures=True)
    out = last_json(proc)
    assert all("_stored_" in o for o in out["stored"]) and len(out["stored"]) == 3
    assert out["again"] == ["Tensor", "Tensor_Tensor", "Tensor_float"]
    assert out["same"]


def test_archives_storing_the_same_op_for_different_calls(archives, tmp_path):
    resaved = tmp_path / "resaved.pt2"
    out = last_json(
        run_script("two_archives.py", [archives / "cube32.pt2", archives / "cube64.pt2", resaved],
                   tmp_path, with_fixtures=False)
    )  # fmt: skip
    assert out["a"] != out["b"] and out["a"] == out["a2"]
    assert out["a"].startswith("Tensor_stored_") and out["b"].startswith("Tensor_stored_")
    again = last_json(run_script("reload.py", [resaved], tmp_path, with_fixtures=False))
    assert again["overload"] == out["b"]  # the suffix is replaced, not stacked


def test_a_stored_program_that_fails_to_read_fails_every_time(archives, tmp_path):
    """The op is defined before its programs are read; a second load of the same
    (corrupted) archive must not find it half made and succeed."""
    import archive_corpus as C

    bad = tmp_path / "bad.pt2"
    C.rewrite(archives / "cube32.pt2", bad,
              lambda n, b: b[: len(b) // 2] + b"A" * (len(b) - len(b) // 2) if n.endswith(".fwd") else b)  # fmt: skip
    proc = run_script("load_twice.py", [bad], tmp_path, with_fixtures=False)
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "the stored fwd program of opaque::ArchCube.Tensor" in first
    assert second == first
