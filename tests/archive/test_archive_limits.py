"""Crafted archives that would make the loader allocate, spin or crash: a huge
zip central directory, tensors whose metadata does not fit their bytes,
pickled sparse tensors with indices out of range, integers of thousands of
digits in the JSON entries. Each is an ArchiveError naming the part, with
memory bounded (peak RSS of a child process) and no crash (the pickled
tensors are loaded in a child process, so a crash fails the test).

Work is bounded by counts and bytes, never by wall-clock time.
"""

import io
import json
import struct
import zipfile

import pytest
import torch

import torch_opaque
import archive_corpus as C
from opaque_fixtures import archops
from support.processes import last_json, run_python
from torch_opaque.archive import program
from torch_opaque.archive.zipio import ArchiveLimits, ZipReader, loads_json

ALLOW = ["opaque_fixtures"]
WEIGHTS_CONFIG = "/data/weights/model_weights_config.json"
MiB = 1 << 20


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    torch_opaque.save(archops.export_net(), d / "net.pt2")
    return d / "net.pt2"


def central_directory_zip(path, records: int, declared=None, zip64: bool = True, distinct: bool = False) -> None:
    """A zip of `records` central-directory records (distinct names, all
    pointing at one empty local entry, or each at its own with `distinct`); its
    end record declares `declared` entries (default: `records`), through the
    zip64 records or not."""
    one = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, 9, 0)
    local = b"".join(one + b"a/%07d" % i for i in range(records if distinct else 1))
    head = struct.pack("<4s6H3L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, 0, 0, 0)
    cd = b"".join(
        head + struct.pack("<5H2L", 9, 0, 0, 0, 0, 0, (len(one) + 9) * i if distinct else 0) + b"a/%07d" % i
        for i in range(records)
    )
    n = records if declared is None else declared
    out = local + cd
    if zip64:
        at = len(out)
        out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), len(local))
        out += struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(cd), len(local), 0)
    path.write_bytes(out)


def edit_weight(src, dst, meta_edit=None, data=None, weight="a.weight") -> str:
    """Copies an archive with `weight`'s config record edited in place and its
    entry's bytes replaced by `data` (when given); returns the entry name."""
    with zipfile.ZipFile(src) as zf:
        (cfg,) = [n for n in zf.namelist() if n.endswith(WEIGHTS_CONFIG)]
        path = json.loads(zf.read(cfg))["config"][weight]["path_name"]

    def fn(d):
        if meta_edit is not None:
            meta_edit(d["config"][weight])

    edit = C.edit_json(WEIGHTS_CONFIG, fn)
    C.rewrite(src, dst, lambda n, b: data if data is not None and n.endswith("/data/weights/" + path) else edit(n, b))
    return "data/weights/" + path


def run_cases(tmp_path, cases: list) -> dict:
    """Loads each (name, path) in a fresh interpreter after loading `warm` once
    (so imports do not count); per case the error and the growth of the peak RSS."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = run_python(
        """
        import json, resource, sys
        import torch_opaque
        cases = json.load(open(sys.argv[1]))
        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {}
        for name, path in cases:
            before = peak()
            try:
                torch_opaque.load(path, allow=["opaque_fixtures"])
                r = ["ok", ""]
            except Exception as e:
                r = [type(e).__name__, str(e)]
            out[name] = r + [peak() - before]
        print(json.dumps(out))
        """,
        args=[spec],
        with_fixtures=True,
        timeout=600,
    )
    return last_json(proc)


# ---- the zip central directory ---------------------------------------------------------


def test_huge_central_directory_refused_before_zipfile_parses_it(net, tmp_path):
    """1M records (a 55 MiB file): zipfile alone would build 1M ZipInfos
    (~450 MiB) before the entry count could be checked."""
    many = tmp_path / "many.pt2"
    central_directory_zip(many, 1_000_000)
    lying = tmp_path / "lying.pt2"  # the end record says 3 entries; the directory holds 1M
    central_directory_zip(lying, 1_000_000, declared=3)
    zero = tmp_path / "zero.pt2"
    edit_weight(net, zero, lambda m: m["tensor_meta"].update(
        sizes=[{"as_int": 256}, {"as_int": 1024}, {"as_int": 1024}],
        strides=[{"as_int": 1 << 20}, {"as_int": 1024}, {"as_int": 1}]), data=b"")  # fmt: skip
    # the zip cases first: they are refused before anything past `import torch_opaque` is imported
    out = run_cases(tmp_path, [["many", str(many)], ["lying", str(lying)], ["warm", str(net)], ["zero", str(zero)]])
    assert out["warm"][0] == "ok", out["warm"]
    kind, msg, grew = out["many"]
    assert kind == "ArchiveError", msg
    assert "1000000 entries" in msg and "limit of 100000" in msg and "limits=ArchiveLimits(entries=...)" in msg
    assert grew < 48 * MiB, grew
    kind, msg, grew = out["lying"]
    assert kind == "ArchiveError" and "central directory" in msg and "for 3 entries" in msg, msg
    assert grew < 48 * MiB, grew
    # a 0-byte weight entry declaring 256x1024x1024 floats (1 GiB): torch.zeros before
    kind, msg, grew = out["zero"]
    assert kind == "ArchiveError" and "weight 'a.weight'" in msg and "holds no bytes" in msg, msg
    assert "data/weights/weight_0" in msg, msg
    assert grew < 256 * MiB, grew


@pytest.mark.parametrize("zip64", [False, True])
def test_entry_count_over_the_limit_from_the_end_record(tmp_path, zip64):
    p = tmp_path / "z.pt2"
    central_directory_zip(p, 2000, zip64=zip64, distinct=True)
    for src in (p, io.BytesIO(p.read_bytes())):
        with pytest.raises(torch_opaque.ArchiveError, match=r"has 2000 entries, more than the limit of 1000 .*ArchiveLimits\(entries="):
            ZipReader(src, "z.pt2", ArchiveLimits(entries=1000))
    with ZipReader(p, "z.pt2", ArchiveLimits(entries=2000)) as z:  # within the limit: read as before
        assert len(z.names) == 2000


def test_central_directory_holding_more_records_than_declared(tmp_path):
    p = tmp_path / "z.pt2"
    central_directory_zip(p, 50, declared=40)  # 50 records fit the size bound of 40
    with pytest.raises(torch_opaque.ArchiveError, match="holds more records than the 40"):
        ZipReader(p, "z.pt2", ArchiveLimits())
    central_directory_zip(p, 5, declared=50)  # 5 records cannot be the directory of 50
    with pytest.raises(torch_opaque.ArchiveError, match="central directory of 275 bytes for 50 entries"):
        ZipReader(p, "z.pt2", ArchiveLimits())


def test_saturated_classic_end_record_counts_records_up_to_the_limit(tmp_path):
    """A classic end record saying 65535 (writers without zip64 saturate it)
    stands for any number of records: they are counted up to the limit."""
    p = tmp_path / "z.pt2"
    central_directory_zip(p, 70_000, declared=0xFFFF, zip64=False, distinct=True)
    with ZipReader(p, "z.pt2", ArchiveLimits()) as z:
        assert len(z.names) == 70_000
    with pytest.raises(torch_opaque.ArchiveError, match=r"has at least 66001 entries, more than the limit of 66000"):
        ZipReader(p, "z.pt2", ArchiveLimits(entries=66_000))


def test_zip64_archive_written_by_zipfile_reads(tmp_path):
    """More than 65535 entries: zipfile writes the zip64 end records, read the
    same way zipfile reads them."""
    p = tmp_path / "z64.pt2"
    with zipfile.ZipFile(p, "w") as zf:
        for i in range(66_000):
            zf.writestr(f"m/{i}", b"")
        zf.comment = b"a comment"
    with ZipReader(p, "z64.pt2", ArchiveLimits()) as z:
        assert len(z.names) == 66_000
    with pytest.raises(torch_opaque.ArchiveError, match="has 66000 entries"):
        ZipReader(p, "z64.pt2", ArchiveLimits(entries=65_999))


# ---- raw tensors ---------------------------------------------------------------------------


def _sizes(*v):
    return [{"as_int": x} for x in v]


@pytest.mark.parametrize(
    "meta_edit, data, expect",
    [
        # storage too small for the view (a.weight's entry holds 48 floats)
        (lambda m: m["tensor_meta"].update(sizes=_sizes(1000, 1000), strides=_sizes(1000, 1)), None, "bytes of storage"),
        (lambda m: m["tensor_meta"].update(storage_offset={"as_int": 10**6}), None, "bytes of storage"),
        # a stride-0 view of one element declaring 4 TiB
        (lambda m: m["tensor_meta"].update(sizes=_sizes(1 << 40), strides=_sizes(0)), None, "tensors limit"),
        (lambda m: m["tensor_meta"].update(strides=_sizes(-4, 1)), None, "is not an integer in [0, 2**63)"),
        (lambda m: m["tensor_meta"].update(sizes=_sizes(1 << 63, 1)), None, "is not an integer in [0, 2**63)"),
        (lambda m: m["tensor_meta"].update(sizes=_sizes(6.0, 8)), None, "is not an integer"),
        (lambda m: m["tensor_meta"].update(sizes=_sizes(*[1] * 65), strides=_sizes(*[1] * 65)), None, "at most 64"),
        (lambda m: m["tensor_meta"].update(strides=_sizes(1)), None, "1 strides"),
        (lambda m: m["tensor_meta"].update(dtype=99), None, "dtype 99"),
        (lambda m: m["tensor_meta"].update(layout=1), None, "not strided"),
        (lambda m: m["tensor_meta"].update(device={"type": "cpu; x", "index": None}), None, "not a device"),
        (lambda m: m.update(use_pickle="no"), None, "use_pickle"),
        (None, b"\0" * 190, "whole number"),
    ],
)
def test_raw_tensor_metadata_must_fit_its_bytes(net, tmp_path, meta_edit, data, expect):
    p = tmp_path / "w.pt2"
    entry = edit_weight(net, p, meta_edit, data)
    with pytest.raises(torch_opaque.ArchiveError) as e:
        torch_opaque.load(p, allow=ALLOW)
    msg = str(e.value)
    assert "weight 'a.weight'" in msg and entry in msg and expect in msg, msg


def _read_tensors(path):
    with ZipReader(path, "w.pt2", ArchiveLimits()) as z:
        root = program.archive_root(z)
        return program.read_tensors(z, root, "model", "w.pt2")


def test_empty_entries_torch_writes_are_read(net, tmp_path):
    """torch writes an empty entry for a tensor without elements and for a meta
    tensor (whatever its size): both read, without allocating."""
    p = tmp_path / "w.pt2"
    edit_weight(net, p, lambda m: m["tensor_meta"].update(sizes=_sizes(0, 5), strides=_sizes(5, 1)), data=b"")
    w = _read_tensors(p)[0]["a.weight"]
    assert w.shape == (0, 5) and isinstance(w, torch.nn.Parameter)
    edit_weight(net, p, lambda m: m["tensor_meta"].update(
        sizes=_sizes(256, 1 << 20), strides=_sizes(1 << 20, 1), device={"type": "meta", "index": None}), data=b"")  # fmt: skip
    w = _read_tensors(p)[0]["a.weight"]
    assert w.is_meta and w.shape == (256, 1 << 20)


# ---- pickled tensors -----------------------------------------------------------------------


def _pickled(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _pickled_weight(net, dst, t):
    edit_weight(net, dst, lambda m: m.update(use_pickle=True), data=_pickled(t))


def test_pickled_tensors_that_cannot_be_checked_are_refused(net, tmp_path):
    """weights_only=True skips sparse invariants: a COO index past the size
    loads, and its first use writes out of bounds (SIGSEGV). Loaded in a child
    process, so a crash fails the test instead of killing pytest."""
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1 << 30], [0, 0]]), torch.ones(2), (4, 8), check_invariants=False)
    csr = torch.sparse_csr_tensor(
        torch.tensor([0, 1, 2, 2, 2]), torch.tensor([0, 1 << 20]), torch.ones(2), (4, 8), check_invariants=False
    )
    csc = torch.sparse_csc_tensor(
        torch.tensor([0, 1, 2, 2, 2, 2, 2, 2, 2]), torch.tensor([0, 99]), torch.ones(2), (4, 8), check_invariants=False
    )
    bsr = torch.sparse_bsr_tensor(
        torch.tensor([0, 1, 1]), torch.tensor([7]), torch.ones(1, 2, 2), (4, 8), check_invariants=False
    )
    cases = {
        "coo": coo,
        "coo_param": torch.nn.Parameter(coo, requires_grad=False),
        "csr": csr,
        "csc": csc,
        "bsr": bsr,
        "quantized": torch.quantize_per_tensor(torch.ones(4, 8), 0.1, 0, torch.quint8),
        "meta": torch.empty(4, 8, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    }
    spec = []
    for name, t in cases.items():
        p = tmp_path / f"{name}.pt2"
        _pickled_weight(net, p, t)
        spec.append([name, str(p)])
    out = run_cases(tmp_path, spec)
    expect = {
        "coo": "size is inconsistent with indices",
        "coo_param": "size is inconsistent with indices",
        "csr": "col_indices",
        "csc": "row_indices",
        "bsr": "col_indices",
        "quantized": "quantized",
        "meta": "meta",
        "nested": "nested",
    }
    for name, frag in expect.items():
        kind, msg, _ = out[name]
        assert kind == "ArchiveError", (name, kind, msg)
        assert "weight 'a.weight'" in msg and "data/weights/weight_0" in msg and frag in msg, (name, msg)


def test_valid_pickled_tensors_are_read(tmp_path):
    """What the checks accept: dense tensors and parameters, valid sparse ones."""
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 3], [1, 7]]), torch.ones(2), (4, 8), check_invariants=True)
    csr = coo.to_sparse_csr()
    for t in (torch.arange(12.0).reshape(3, 4)[:, 1:], torch.nn.Parameter(torch.ones(3)), coo, csr):
        p = tmp_path / "t.zip"
        with zipfile.ZipFile(p, "w") as zf:
            zf.writestr("m/t", _pickled(t))
        with ZipReader(p, "t.zip", ArchiveLimits()) as z:
            got = program._unpickle_tensor(z, "m/t", "weight 't'", "t.zip")
        assert type(got) is type(t) and got.layout == t.layout
        assert torch.equal(got.to_dense(), t.detach().to_dense())


# ---- integers in JSON ------------------------------------------------------------------------


def test_huge_integer_in_manifest_names_the_manifest(net, tmp_path):
    p = tmp_path / "m.pt2"
    big = b"9" * 5000
    C.rewrite(net, p, lambda n, b: b.replace(b"{", b'{"x": ' + big + b", ", 1) if n.endswith("/extra/torch_opaque.json") else b)
    with pytest.raises(torch_opaque.ArchiveError) as e:
        torch_opaque.load(p, allow=ALLOW)
    msg = str(e.value)
    assert "torch_opaque.json" in msg and "5000 digits" in msg, msg


def test_huge_integer_in_graph_names_the_entry(net, tmp_path):
    p = tmp_path / "g.pt2"
    big = b"-" + b"9" * 5000
    C.rewrite(net, p, lambda n, b: b.replace(b"{", b'{"x": ' + big + b", ", 1) if n.endswith("/models/model.json") else b)
    with pytest.raises(torch_opaque.ArchiveError) as e:
        torch_opaque.load(p, allow=ALLOW)
    msg = str(e.value)
    assert "models/model.json" in msg and "5000 digits" in msg, msg


def test_json_numbers_torch_writes_are_kept():
    """int64 / uint64 bounds, and the strings torch writes for non-finite floats."""
    text = '[9223372036854775807, -9223372036854775808, 18446744073709551615, 1e308, "Infinity", "NaN", null]'
    assert loads_json(text) == json.loads(text)
    for bad in ("123456789012345678901", "NaN", "-Infinity", "Infinity", "1e999", "[" * 100_000):
        with pytest.raises((ValueError, RecursionError)):
            loads_json(bad)
