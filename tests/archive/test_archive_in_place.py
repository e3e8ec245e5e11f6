"""Archives of programs calling an in-place op (Note [In-place Functions]):
the manifest records which outputs are written into which arguments, so a
fresh process defines the same mutable schema; self-contained archives refuse
them clearly."""

import json

import pytest
import torch

import torch_opaque
from opaque_fixtures import inplaceops
from support.processes import last_json, run_script
from torch_opaque.errors import ArchiveError


def test_manifest_archive_loads_in_a_fresh_process(tmp_path):
    x = torch.randn(5)
    ep = torch.export.export(inplaceops.Net(), (x,))
    torch_opaque.save(ep, tmp_path / "net.pt2")
    torch.save({"x": x, "y": inplaceops.Net()(x.clone())}, tmp_path / "ref.pt")
    opts = json.dumps({"allow": ["opaque_fixtures"]})
    proc = run_script("load_and_run.py", [tmp_path / "net.pt2", opts, tmp_path / "ref.pt"], tmp_path, True)
    assert "opaque_fixtures.inplaceops" in last_json(proc)["imported"]


@pytest.mark.parametrize("net", [inplaceops.Net, inplaceops.AutocastNet], ids=["plain", "autocast"])
def test_decomposed_program_loads_in_a_fresh_process(tmp_path, net):
    # run_decompositions wraps each in-place call in an auto_functionalized node
    x = torch.randn(2, 5)
    ep = torch.export.export(net(), (x,)).run_decompositions()
    assert any("auto_functionalized" in str(n.target) for n in ep.graph.nodes), ep.graph
    torch_opaque.save(ep, tmp_path / "net.pt2")
    want = net()(x.clone())
    assert want.dtype == (torch.bfloat16 if net is inplaceops.AutocastNet else torch.float32)
    torch.save({"x": x, "y": want}, tmp_path / "ref.pt")
    opts = json.dumps({"allow": ["opaque_fixtures"]})
    proc = run_script("load_and_run.py", [tmp_path / "net.pt2", opts, tmp_path / "ref.pt"], tmp_path, True)
    assert "opaque_fixtures.inplaceops" in last_json(proc)["imported"]


def test_manifest_names_the_dirty_pairs_and_the_mutable_schema(tmp_path):
    import zipfile

    ep = torch.export.export(inplaceops.Net(), (torch.randn(3),))
    torch_opaque.save(ep, tmp_path / "net.pt2")
    with zipfile.ZipFile(tmp_path / "net.pt2") as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    (op,) = manifest["ops"]
    (ov,) = op["overloads"]
    assert ov["schema"].startswith("opaque::ArchScaleInPlace.Tensor_float(Tensor(a!) x, float k) -> ()")
    assert ov["dirty"] == [[0, 0]] and ov["n_out"] == 1


def test_self_contained_archive_refuses_in_place_ops(tmp_path):
    ep = torch.export.export(inplaceops.Net(), (torch.randn(3),))
    with pytest.raises(ArchiveError, match="torch_opaque.save\\(self_contained=True\\): "
                       "opaque::ArchScaleInPlace .* modifies its arguments in place"):
        torch_opaque.save(ep, tmp_path / "sc.pt2", self_contained=True)
    assert not (tmp_path / "sc.pt2").exists()
