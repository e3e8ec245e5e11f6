"""Training programs (torch_opaque.export_training) saved with torch_opaque.save
and loaded in a fresh process: the loss and gradients equal eager autograd of
the saving process, through the custom backwards, with the defining module imported (allow=) or
without any user code (self_contained=True)."""

import json
import zipfile

import pytest
import torch

import torch_opaque
from opaque_fixtures import archops
from support.processes import last_json, run_script

FIXTURE_MODULE = "opaque_fixtures.archops"


def mse_to_zero(y):
    return y.pow(2).mean()


def export_step():
    batch = torch.export.Dim("batch", min=2)
    return torch_opaque.export_training(
        archops.Net(), (archops.example_input(),), loss=mse_to_zero, dynamic_shapes=({0: batch},)
    )


def eager_step(x):
    net = archops.Net()
    loss = mse_to_zero(net(x))
    loss.backward()
    return [loss.detach()] + [p.grad for p in net.parameters()]




@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("training_archives")
    step = export_step()
    torch_opaque.save(step, d / "step.pt2")
    torch_opaque.save(step, d / "step_sc.pt2", self_contained=True)
    xs = [archops.example_input(7), archops.example_input(3)]
    want = [eager_step(x) for x in xs]
    for x, w in zip(xs, want):  # the program itself equals eager before saving
        for g, e in zip(step.module()(x), w):
            torch.testing.assert_close(g, e)
    names = torch_opaque.training_outputs(step)
    torch.save({"xs": xs, "want": want, "names": names}, d / "ref.pt")
    return d


def test_training_program_loads_with_its_module_in_a_fresh_process(saved, tmp_path):
    opts = json.dumps({"allow": ["opaque_fixtures"]})
    proc = run_script("load_training_step.py", [saved / "step.pt2", saved / "ref.pt", opts], tmp_path, True)
    out = last_json(proc)
    assert out["imported"] == ["opaque_fixtures", FIXTURE_MODULE]
    # (ArchCube acts on the input, which needs no gradient: no backward call)
    assert out["bwd_overloads"] == [
        "opaque.ArchMulAdd_bwd.Tensor_Tensor", "opaque.ArchScaledSin_bwd.Tensor_float",
    ]


def test_self_contained_training_program_needs_no_user_code(saved, tmp_path):
    proc = run_script("load_training_step.py", [saved / "step_sc.pt2", saved / "ref.pt", "{}"], tmp_path, False)
    out = last_json(proc)
    assert out["imported"] == []
    # the stored backwards ran (their own overloads), not the Functions
    assert len(out["bwd_overloads"]) == 2
    assert all("_stored_" in t for t in out["bwd_overloads"]), out


def test_self_contained_manifest_records_the_state_of_each_kind_of_call(saved):
    with zipfile.ZipFile(saved / "step_sc.pt2") as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    ops = {op["qualified_name"]: op for op in manifest["ops"]}
    (ov,) = ops["opaque::ArchScaledSin"]["overloads"]
    assert ov["calls"] == {"op": 0, "fwd": 1, "bwd": 1}
    (variant,) = ov["variants"]
    assert "1.5" in variant["state"]


def test_self_contained_training_program_also_loads_with_the_module(saved, tmp_path):
    """The graph is saved unchanged: with allow= the real Functions run it."""
    opts = json.dumps({"allow": ["opaque_fixtures"]})
    proc = run_script("load_training_step.py", [saved / "step_sc.pt2", saved / "ref.pt", opts], tmp_path, True)
    out = last_json(proc)
    assert out["imported"] == ["opaque_fixtures", FIXTURE_MODULE]
    assert not any("_stored_" in t for t in out["bwd_overloads"]), out


def test_plain_torch_export_load_reads_a_saved_training_program(saved):
    """The archive is a plain pt2 archive (Note [Serializing Tensor?[] results])."""
    ep = torch.export.load(saved / "step.pt2")  # the ops are registered in this process
    x = archops.example_input(7)
    for g, w in zip(ep.module()(x), eager_step(x)):
        torch.testing.assert_close(g, w)
