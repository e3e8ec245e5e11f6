"""Unit tests of the archive's pieces: the manifest reader, stored values, guards
and the size limits (symbolic expressions: test_sym_expr.py)."""

import io
import json
import zipfile

import pytest
import torch

import torch_opaque
from torch_opaque.archive.manifest import SAVED_KIND_NAMES, SAVED_KINDS, VERSION, parse_manifest
from torch_opaque.archive.graph_grammar import check_guard
from torch_opaque.archive.values import decode_value, encode_value
from torch_opaque.archive.zipio import ArchiveLimits, ZipReader, bad_name
from torch_opaque.errors import ArchiveError, TorchOpaqueError

from support.processes import FIXTURES_DIR

FIXTURES = str(FIXTURES_DIR)


def _manifest_bytes(path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/extra/torch_opaque.json")]
        return zf.read(name)


def test_version_1_saved_kinds_are_read_by_name():
    raw = _manifest_bytes(f"{FIXTURES}/v1_net_sc.pt2")
    assert json.loads(raw)["version"] == 1
    m = parse_manifest(raw, "v1")
    muladd = next(op for op in m.ops if op.name == "ArchMulAdd")
    (v,) = muladd.overloads[0].variants
    assert [(s.kind, s.index, s.item) for s in v.saved] == [("input", 0, 0), ("input", 1, 0), ("residual", 0, 0)]
    assert v.saved_codes() == [1, 0, 0, 1, 1, 0, 4, 0, 0]  # include/torch_opaque/forward_record.h
    # written again, it is version 2 with names, and reads back the same
    again = parse_manifest(m.to_json().encode(), "v2")
    assert json.loads(m.to_json())["version"] == VERSION == 2
    assert again == dataclass_replace_version(m, 2)
    text = json.loads(m.to_json())
    saved = next(o for o in text["ops"] if o["name"] == "ArchMulAdd")["overloads"][0]["variants"][0]["saved"]
    assert saved == [["input", 0, 0], ["input", 1, 0], ["residual", 0, 0]]


def dataclass_replace_version(m, version):
    import dataclasses

    return dataclasses.replace(m, version=version)


def test_saved_kind_names_follow_the_cpp_enum():
    header = open(f"{FIXTURES}/../../include/torch_opaque/forward_record.h").read()
    for code, cpp in enumerate(["None = 0", "Input = 1", "InputListItem = 2", "Output = 3", "Residual = 4"]):
        assert cpp in header
    assert SAVED_KINDS == ("none", "input", "input_item", "output", "residual")
    assert {int(k): n for k, n in SAVED_KIND_NAMES.items()} == dict(enumerate(SAVED_KINDS))


def test_save_writes_version_2(tmp_path):
    from opaque_fixtures import archops

    torch_opaque.save(archops.export_net(), tmp_path / "sc.pt2", self_contained=True)
    d = json.loads(_manifest_bytes(tmp_path / "sc.pt2"))
    assert d["version"] == 2
    kinds = {s[0] for op in d["ops"] for v in op["overloads"][0]["variants"] for s in v["saved"]}
    assert kinds <= set(SAVED_KINDS) and "residual" in kinds


class ScaleDefault(torch.autograd.Function):
    """Hinted defaults a schema prints otherwise than Python does (3.0 -> 3.)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float = 3.0, w: torch.Tensor | None = None) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None, None


def test_float_defaults_round_trip(tmp_path):
    torch_opaque.wrap(ScaleDefault)

    class Net(torch.nn.Module):
        def forward(self, x):
            return ScaleDefault.apply(x)

    torch_opaque.save(torch.export.export(Net(), (torch.randn(3),)), tmp_path / "d.pt2",
                      self_contained=True)
    (ov,) = [op for op in parse_manifest(_manifest_bytes(tmp_path / "d.pt2"), "d").ops][0].overloads
    assert "k=3." in ov.schema and "k=3.0" in ov.arguments  # the texts differ, the arguments do not
    loaded = torch_opaque.load(tmp_path / "d.pt2")
    torch.testing.assert_close(loaded.module()(torch.ones(3)), torch.full((3,), 3.0))


@pytest.mark.parametrize(
    "value, decoded",
    [
        ({"dtype": "float16"}, torch.float16),
        ({"layout": "strided"}, torch.strided),
        ({"memory_format": "channels_last"}, torch.channels_last),
        ({"device": "cpu"}, torch.device("cpu")),
        ({"float": "1.5"}, 1.5),
        ([1, {"dtype": "int8"}], [1, torch.int8]),
    ],
)
def test_value_tags_come_from_tables(value, decoded):
    assert decode_value(value) == decoded
    assert encode_value(decoded) == value


@pytest.mark.parametrize(
    "value, why",
    [
        ({"dtype": "Tensor"}, "unknown dtype 'Tensor'"),  # getattr(torch, "Tensor") would succeed
        ({"dtype": "load"}, "unknown dtype 'load'"),
        ({"layout": "float32"}, "unknown layout"),
        ({"device": "cpu; x"}, "unknown device"),
        ({"eval": "1"}, "unknown value tag 'eval'"),
        ({"dtype": "float32", "x": 1}, "one key"),
        (1.5, "not a stored value"),
    ],
)
def test_value_tags_outside_the_tables_are_refused(value, why):
    with pytest.raises(ValueError, match=why):
        decode_value(value)


@pytest.mark.parametrize(
    "name, bad",
    [("a/b.json", False), ("a/../b", True), ("/etc/x", True), ("a\\b", True), ("C:x", True), ("a/./b", True), ("a\x00b", True)],
)
def test_entry_names(name, bad):
    assert (bad_name(name) is not None) is bad


def test_limits_keyword(tmp_path):
    path = f"{FIXTURES}/v1_net.pt2"
    with pytest.raises(ArchiveError, match=r"entry 'v1_net/models/model.json' .* more than the model limit of 1000 bytes. Raise it with limits=ArchiveLimits\(model=...\)"):
        torch_opaque.load(path, limits=ArchiveLimits(model=1000))
    with pytest.raises(ArchiveError, match="exceeds the limit of 100 bytes at entry 'v1_net/data/weights/weight_0'"):
        torch_opaque.load(path, limits=ArchiveLimits(tensors=100))
    with pytest.raises(ArchiveError, match="holds more than 5000 bytes of manifest, graphs and stored programs"):
        torch_opaque.load(f"{FIXTURES}/v1_net_sc.pt2", limits=ArchiveLimits(metadata=5000))
    with pytest.raises(ValueError, match="ArchiveLimits.model must be a positive int"):
        ArchiveLimits(model=0)
    with pytest.raises(TypeError, match="limits must be an ArchiveLimits"):
        torch_opaque.load(path, limits={"model": 1})


def test_reads_stop_at_the_declared_size():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("r/extra/x", b"y" * 100)
    with ZipReader(buf, "<buf>", ArchiveLimits()) as z:
        assert z.read("r/extra/x", "other") == b"y" * 100
        z.infos["r/extra/x"].file_size = 10  # a header that lies
        with pytest.raises(ArchiveError, match="fails its CRC check"):
            z.read("r/extra/x", "other")


def test_errors_share_one_base():
    for cls in (torch_opaque.ArchiveError, torch_opaque.OpNotAllowedError, torch_opaque.SchemaError,
                torch_opaque.FakeForwardError, torch_opaque.UnsupportedError):  # fmt: skip
        assert issubclass(cls, TorchOpaqueError)
    assert issubclass(torch_opaque.ArchiveError, RuntimeError)
    assert issubclass(torch_opaque.SchemaError, TypeError)


@pytest.mark.parametrize(
    "guard, why",
    [
        ("L['x'].size()[0] > 3", None),
        ("L['x'].size()[0] == L['y'].size()[0]", None),
        ("2 <= L['x'].size()[0] and L['x'].stride()[1] == 1", None),
        ("__import__('os').system('x')", "a call that is not a size query"),
        ("L['x'].size()[0] > os", "unknown name 'os'"),
        ("L['x'].__class__", "attribute '__class__'"),
        ("L['x'].size(*()) > 1", ""),
        ("(lambda: 1)()", "a call that is not a size query"),
        ("L['x\"); import os; (\"'].size()[0] > 1", "not an input name"),
    ],
)
def test_guards(guard, why):
    tree, got = check_guard(guard)
    assert got == why if why is None else why in got, got
    assert (tree is None) is (why is not None)
