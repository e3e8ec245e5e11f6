"""torch_opaque.save / torch_opaque.load: archives that travel to fresh processes.

Every load runs in a fresh subprocess (sys.executable) where the ops are not
registered; each subprocess reports which test-fixture modules it imported.
"""

import json
import zipfile

import pytest
import torch

import torch_opaque
from opaque_fixtures import archops
from support.processes import last_json, run_script

FIXTURE_MODULE = "opaque_fixtures.archops"


# The subprocess side: tests/support/scripts/load_*.py.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """net.pt2 (manifest only), net_sc.pt2 (self-contained) and the reference
    results of the saving process."""
    d = tmp_path_factory.mktemp("archives")
    ep = archops.export_net()
    torch_opaque.save(ep, d / "net.pt2")
    torch_opaque.save(ep, d / "net_sc.pt2", self_contained=True)
    torch.export.save(ep, d / "plain.pt2")

    net = archops.Net()
    x = archops.example_input(7)
    xg = x.clone().requires_grad_()
    y = net(xg)
    y.sum().backward()
    torch.save(
        {
            "x": x,
            "y": y.detach(),
            "x_grad": xg.grad,
            "param_grads": {n: p.grad for n, p in net.named_parameters()},
        },
        d / "ref.pt",
    )
    return d


def test_manifest_records_ops_modules_and_schemas(saved):
    with zipfile.ZipFile(saved / "net.pt2") as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    assert manifest["format"] == "torch_opaque.archive" and manifest["self_contained"] is False
    ops = {op["qualified_name"]: op for op in manifest["ops"]}
    assert sorted(ops) == ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]
    sin = ops["opaque::ArchScaledSin"]
    assert sin["module"] == FIXTURE_MODULE and sin["class"] == "ScaledSin"
    (ov,) = sin["overloads"]
    assert ov["overload"] == "Tensor_float"
    assert ov["schema"] == "opaque::ArchScaledSin.Tensor_float(Tensor x, float scale) -> Tensor"
    assert ov["calls"] == {"op": 1, "fwd": 0, "bwd": 0}
    assert "variants" not in ov


def test_load_allowed_module_runs_and_trains(saved, tmp_path):
    proc = run_script(
        "load_run_train.py",
        [saved / "net.pt2", saved / "ref.pt", json.dumps({"allow": ["opaque_fixtures"]})],
        tmp_path,
        with_fixtures=True,
    )
    out = last_json(proc)
    assert out["imported"] == ["opaque_fixtures", FIXTURE_MODULE]
    assert out["ops"] == ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]


def test_allow_a_single_module_name(saved, tmp_path):
    opts = json.dumps({"allow": FIXTURE_MODULE})  # one string, not a list
    proc = run_script("load_and_run.py", [saved / "net.pt2", opts, saved / "ref.pt"], tmp_path, True)
    assert last_json(proc) == {"imported": ["opaque_fixtures", FIXTURE_MODULE]}


@pytest.mark.parametrize(
    "allow, allow_all, allowed",
    [
        (["opaque_fixtures"], False, True),
        (["opaque_fixtures.archops"], False, True),
        (["opaque_fixtures.*"], False, True),
        (["opaque_fixtures."], False, True),
        (["unrelated", "opaque_fixtures"], False, True),
        ([], True, True),
        ([], False, False),
        (["opaque_fixtures.archops.sub"], False, False),
        (["opaque_fix"], False, False),
        (["opaque_fixtures_evil"], False, False),
    ],
)
def test_allow_list_matching(allow, allow_all, allowed):
    from torch_opaque.archive.loading import _allowed

    assert _allowed(FIXTURE_MODULE, allow, allow_all) is allowed
    assert _allowed("__main__", allow, True) is False  # never importable


def test_load_without_permission_names_op_module_and_fix(saved, tmp_path):
    path = saved / "net.pt2"
    proc = run_script("load_expect_error.py", [path, "{}"], tmp_path, with_fixtures=True)
    out = last_json(proc)
    err = out["error"]
    assert err["type"] == "OpNotAllowedError" and err["is_archive_error"]
    msg = err["message"]
    for op in ("opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"):
        assert op in msg
    assert f"class Cube in module {FIXTURE_MODULE}" in msg
    assert f"torch_opaque.load({str(path)!r}, allow=['{FIXTURE_MODULE}'])" in msg
    assert "Nothing was imported" in msg
    assert out["imported"] == []  # importable, but not imported


def test_load_with_allow_list_not_covering_the_module(saved, tmp_path):
    opts = json.dumps({"allow": ["some_other_package", "opaque_fixtures_not"]})
    proc = run_script("load_expect_error.py", [saved / "net.pt2", opts], tmp_path, with_fixtures=True)
    out = last_json(proc)
    msg = out["error"]["message"]
    assert out["error"]["type"] == "OpNotAllowedError"
    assert f"module {FIXTURE_MODULE} is not in allow=['some_other_package', 'opaque_fixtures_not']" in msg
    assert out["imported"] == []


def test_manifest_naming_a_module_outside_the_allow_list_imports_nothing(saved, tmp_path):
    """A tampered manifest points ArchCube at another (importable) module."""
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    marker = tmp_path / "evil_was_imported"
    (evil_dir / "evil_ops.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    with zipfile.ZipFile(saved / "net.pt2") as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    for op in manifest["ops"]:
        if op["name"] == "ArchCube":
            op["module"] = "evil_ops"
    ep = archops.export_net()
    tampered = tmp_path / "tampered.pt2"
    torch.export.save(ep, tampered, extra_files={"torch_opaque.json": json.dumps(manifest)})

    opts = json.dumps({"allow": ["opaque_fixtures"]})
    proc = run_script(
        "load_expect_error.py", [tampered, opts], tmp_path, with_fixtures=True, extra_path=[evil_dir]
    )
    out = last_json(proc)
    msg = out["error"]["message"]
    assert out["error"]["type"] == "OpNotAllowedError"
    assert "opaque::ArchCube: defined by class Cube in module evil_ops" in msg
    assert "module evil_ops is not in allow=['opaque_fixtures']" in msg
    # nothing at all was imported: not the evil module, not the allowed one either
    assert out["imported"] == []
    assert not marker.exists()


def test_self_contained_loads_runs_and_trains_without_the_module(saved, tmp_path):
    proc = run_script(
        "load_run_train.py",
        [saved / "net_sc.pt2", saved / "ref.pt", "{}"],
        tmp_path,
        with_fixtures=False,
    )
    out = last_json(proc)
    assert out["findable"] is False  # the defining module is absent from sys.path
    assert out["imported"] == []
    assert out["ops"] == ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]


def test_self_contained_manifest_and_programs(saved):
    with zipfile.ZipFile(saved / "net_sc.pt2") as zf:
        names = zf.namelist()
        (name,) = [n for n in names if n.endswith("/extra/torch_opaque.json")]
        manifest = json.loads(zf.read(name))
    assert manifest["self_contained"] is True
    for op in manifest["ops"]:
        (ov,) = op["overloads"]
        (variant,) = ov["variants"]
        # the batch dimension stays symbolic in the stored programs
        assert variant["args"][0]["shape"][0] is None
        for which in ("fwd", "bwd"):
            assert any(n.endswith("/extra/" + variant[which]) for n in names)
    muladd = next(op for op in manifest["ops"] if op["name"] == "ArchMulAdd")
    variant = muladd["overloads"][0]["variants"][0]
    assert variant["n_residuals"] == 1  # prod.tanh() is an intermediate
    assert variant["n_state_ints"] == 1  # ctx.rows = a.shape[0] (symbolic)


def test_self_contained_nested_ops_and_uncovered_calls(tmp_path):
    """A forward that calls another opaque op; a call the stored programs do not
    cover fails clearly."""
    torch_opaque.save(archops.export_nested(), tmp_path / "nested.pt2", self_contained=True)
    out = last_json(run_script("load_nested.py", [tmp_path / "nested.pt2"], tmp_path, with_fixtures=False))
    assert out["imported"] == []
    assert "re-created from the stored programs" in out["message"]
    assert "x: float32[*, 6]" in out["message"] and "x: float64[3, 6]" in out["message"]
    assert "opaque::ArchOuter.Tensor was re-created" in out["message"]
    assert out["overload"].startswith("Tensor_stored_") and out["real_free"]


def test_self_contained_prefers_the_allowed_module(saved, tmp_path):
    proc = run_script(
        "load_run_train.py",
        [saved / "net_sc.pt2", saved / "ref.pt", json.dumps({"allow": ["opaque_fixtures"]})],
        tmp_path,
        with_fixtures=True,
    )
    assert last_json(proc)["imported"] == ["opaque_fixtures", FIXTURE_MODULE]


def _data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start (from its local header)."""
    h = info.header_offset
    name_len = int.from_bytes(data[h + 26 : h + 28], "little")
    extra_len = int.from_bytes(data[h + 28 : h + 30], "little")
    return h + 30 + name_len + extra_len


def corrupt(src, dst, how: str):
    data = bytearray(src.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "flipped":
        # a byte inside the serialized graph
        with zipfile.ZipFile(src) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith("models/model.json"))
        data[_data_offset(data, info) + info.file_size // 2] ^= 0x5A
    elif how == "weights":
        with zipfile.ZipFile(src) as zf:
            info = next(i for i in zf.infolist() if "/data/weights/weight_" in i.filename)
        data[_data_offset(data, info) + 3] ^= 0xFF
    elif how == "garbage":
        data = bytearray(b"this is not a pt2 archive" * 100)
    dst.write_bytes(bytes(data))


def test_corrupted_archives_give_clear_errors_and_import_nothing(saved, tmp_path):
    """The defining module is importable and allowed: still nothing is imported."""
    paths = []
    for how in ("truncated", "flipped", "weights", "garbage"):
        paths.append(tmp_path / f"{how}.pt2")
        corrupt(saved / "net.pt2", paths[-1], how)
    opts = json.dumps({"allow": ["opaque_fixtures"]})
    out = last_json(run_script("load_all_expect_errors.py", [opts, *paths], tmp_path, True))
    assert out["imported"] == []
    for path in paths:
        kind, msg = out["results"][str(path)]
        assert kind == "ArchiveError", msg
        assert msg.startswith(f"torch_opaque: cannot read {path}: BadZipFile: "), msg
        assert "truncated or corrupted" in msg
    assert "File is not a zip file" in out["results"][str(paths[0])][1]
    assert "models/model.json' fails its CRC check" in out["results"][str(paths[1])][1]
    assert "weight_0' fails its CRC check" in out["results"][str(paths[2])][1]


def test_corrupted_manifest_and_stored_program(saved, tmp_path):
    ep = archops.export_net()
    torch.export.save(ep, tmp_path / "badjson.pt2", extra_files={"torch_opaque.json": "{nope"})
    torch.export.save(
        ep,
        tmp_path / "badformat.pt2",
        extra_files={"torch_opaque.json": json.dumps({"format": "something else"})},
    )
    # a self-contained archive whose stored program is garbage
    with zipfile.ZipFile(saved / "net_sc.pt2") as zf:
        extra = {
            n.split("/extra/")[1]: zf.read(n).decode()
            for n in zf.namelist()
            if "/extra/" in n
        }
    program = next(k for k in extra if k.endswith(".fwd"))
    extra[program] = "AAAA" + extra[program][len(extra[program]) // 2 :]
    torch.export.save(ep, tmp_path / "badprog.pt2", extra_files=extra)

    paths = [tmp_path / "badjson.pt2", tmp_path / "badformat.pt2", tmp_path / "badprog.pt2"]
    out = last_json(run_script("load_all_expect_errors.py", ["{}", *paths], tmp_path, True))
    res = out["results"]
    assert out["imported"] == []
    kind, msg = res[str(paths[0])]
    assert kind == "ArchiveError" and "manifest (torch_opaque.json)" in msg
    assert str(paths[0]) in msg and "JSONDecodeError" in msg
    kind, msg = res[str(paths[1])]
    assert kind == "ArchiveError" and "format 'torch_opaque.archive'" in msg
    kind, msg = res[str(paths[2])]
    assert kind == "ArchiveError" and "stored fwd program" in msg and "corrupted" in msg


def test_plain_torch_export_archive_lists_unknown_ops(saved, tmp_path):
    out = last_json(run_script("load_expect_error.py", [saved / "plain.pt2", "{}"], tmp_path, True))
    msg = out["error"]["message"]
    assert out["error"]["type"] == "ArchiveError"
    assert "written by torch.export.save" in msg
    assert "opaque::ArchCube.Tensor" in msg and "opaque::ArchScaledSin.Tensor_float" in msg
    assert out["imported"] == []


def test_load_in_the_saving_process_reuses_registered_ops(saved):
    ep = torch_opaque.load(saved / "net.pt2")  # ops exist here: nothing to import
    ref = torch.load(saved / "ref.pt")
    torch.testing.assert_close(ep.module()(ref["x"]), ref["y"])
    ep = torch_opaque.load(saved / "plain.pt2")
    torch.testing.assert_close(ep.module()(ref["x"]), ref["y"])


def test_save_rejects_non_programs_and_load_rejects_bad_allow(tmp_path):
    with pytest.raises(TypeError, match="ExportedProgram"):
        torch_opaque.save(archops.Net(), tmp_path / "x.pt2")
    with pytest.raises(ValueError, match="module names"):
        torch_opaque.load(tmp_path / "x.pt2", allow=["os; rm -rf /"])
    with pytest.raises(FileNotFoundError):
        torch_opaque.load(tmp_path / "x.pt2")
