"""Identity: an archive records a fingerprint of each Function it names, and
loading where the module now defines a different Function (same name and
schema) is an error, or an explicit choice of which definition runs (Note
[Function fingerprints] in torch_opaque/archive/fingerprint.py).

The module is written to a folder per version; saving and every load run in
child processes (tests/support/scripts/load_cases.py) with that folder on
their path.
"""

import json
import textwrap

import pytest
import torch

from support.processes import run_python
from torch_opaque.archive.fingerprint import function_fingerprint

V1 = '''
import torch, torch_opaque

SCALE = 2.0


@torch_opaque.op(name="IdTwice")
class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * SCALE

    @staticmethod
    def backward(ctx, g):
        return g * SCALE


def make(scale):
    @torch_opaque.op(name="IdScaled")
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale

        @staticmethod
        def backward(ctx, g):
            return g * scale

    return Scaled


Scaled = make(3.0)


class M(torch.nn.Module):
    def forward(self, x):
        return Twice.apply(x) + Scaled.apply(x)
'''

VERSIONS = {
    "v1": V1,
    # the same code, commented and spaced differently: the same fingerprints
    "v1_comments": V1.replace("        return x * SCALE", "        # twice\n\n        return x  *  SCALE  # (doubled)"),
    "v2_forward": V1.replace("        return x * SCALE", "        return x * SCALE + 1"),
    "v2_global": V1.replace("SCALE = 2.0", "SCALE = 5.0"),
    "v2_closure": V1.replace("Scaled = make(3.0)", "Scaled = make(4.0)"),
}
X = [3]
V1_VALUE = 3 * (2 + 3)  # sum of M(ones(3)) as saved

SAVE = r"""
import sys, torch, torch_opaque, idmod
ep = torch.export.export(idmod.M(), (torch.randn(3),))
torch_opaque.save(ep, sys.argv[1])
torch_opaque.save(ep, sys.argv[2], self_contained=True)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity")
    dirs = {}
    for name, src in VERSIONS.items():
        dirs[name] = d / name
        dirs[name].mkdir()
        (dirs[name] / "idmod.py").write_text(textwrap.dedent(src))
    plain, sc = d / "plain.pt2", d / "sc.pt2"
    proc = run_python(SAVE, args=[plain, sc], extra_path=[dirs["v1"]])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"dirs": dirs, "plain": str(plain), "sc": str(sc)}


def run_cases(setup, version: str, cases) -> list:
    proc = run_python(script="load_cases.py", args=[json.dumps(cases)], extra_path=[setup["dirs"][version]])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_refused(report, *parts):
    assert report["error"] is not None and report["error"][0] == "ArchiveError", report
    for p in parts:
        assert p in report["error"][1], (p, report["error"][1])


def test_the_manifest_records_a_fingerprint_of_each_function(setup):
    import archive_corpus as C

    for path in (setup["plain"], setup["sc"]):
        fps = {op["name"]: op.get("fingerprint") for op in C.manifest_of(path)["ops"]}
        assert set(fps) == {"IdTwice", "IdScaled"}
        assert all(isinstance(f, str) and len(f) == 32 for f in fps.values()), fps
        assert fps["IdTwice"] != fps["IdScaled"]


@pytest.mark.parametrize("version", ["v1", "v1_comments"])
def test_the_same_definition_loads_in_another_process(setup, version):
    allow = {"allow": ["idmod"]}
    r = run_cases(setup, version, [
        {"path": setup["plain"], "options": allow, "run": X},
        {"path": setup["sc"], "options": allow, "run": X},
        {"path": setup["sc"], "run": X},
        {"path": setup["sc"], "import_first": "idmod", "run": X},
    ])  # fmt: skip
    for report in r:
        assert report["error"] is None and report["value"] == V1_VALUE, report
        assert report["warnings"] == []


@pytest.mark.parametrize("version, op, cls, changed", [
    ("v2_forward", "IdTwice", "idmod.Twice", 3 * (3 + 3)),
    ("v2_global", "IdTwice", "idmod.Twice", 3 * (5 + 3)),
    ("v2_closure", "IdScaled", "idmod.make.<locals>.Scaled", 3 * (2 + 4)),
])  # fmt: skip
def test_a_changed_function_is_refused_or_run_as_chosen(setup, version, op, cls, changed):
    """(Before: loaded, plain and self-contained with allow=, and silently ran
    the new math.)"""
    allow = ["idmod"]
    r = run_cases(setup, version, [
        {"path": setup["plain"], "options": {"allow": allow}, "run": X, "import_first": "idmod"},
        {"path": setup["sc"], "options": {"allow": allow}, "run": X, "import_first": "idmod"},
        {"path": setup["sc"], "import_first": "idmod", "run": X},
        {"path": setup["plain"], "options": {"allow": allow, "function_changed": "run_process"}, "run": X},
        {"path": setup["sc"], "options": {"allow": allow, "function_changed": "run_stored"}, "run": X},
        {"path": setup["plain"], "options": {"allow": allow, "function_changed": "run_stored"}, "run": X},
    ])  # fmt: skip
    # a process that lacks the op and imports nothing runs the stored programs
    r += run_cases(setup, version, [{"path": setup["sc"], "run": X}])
    # fresh processes where loading imports the module (allow=)
    r += run_cases(setup, version, [{"path": setup["plain"], "options": {"allow": allow}, "run": X}])
    r += run_cases(setup, version, [
        {"path": setup["sc"], "options": {"allow": allow, "function_changed": "run_stored"}, "run": X}
    ])
    for report in r[:3]:
        assert_refused(report, f"another definition of {cls}", f"opaque::{op}",
                       "function_changed='run_process'", "function_changed='run_stored'")
        assert report["value"] is None
    assert r[3]["error"] is None and r[3]["value"] == changed
    assert any("runs this process's definition" in w and op in w for w in r[3]["warnings"]), r[3]
    assert r[4]["error"] is None and r[4]["value"] == V1_VALUE  # the stored (saved) definition
    assert_refused(r[5], "stores none", f"opaque::{op}")
    assert r[6]["error"] is None and r[6]["value"] == V1_VALUE
    assert_refused(r[7], f"another definition of {cls}", "function_changed='run_process'")
    assert r[8]["error"] is None and r[8]["value"] == V1_VALUE


def test_archives_written_before_fingerprints_are_not_compared(setup, tmp_path):
    """An archive whose manifest records no fingerprint (written before
    torch_opaque recorded them: the v1 and v2 fixtures) cannot be compared:
    the process's definition runs, changed or not, as the trust model's
    identity row states."""
    import archive_corpus as C
    from support.processes import FIXTURES_DIR, REPO_DIR

    for fixture in ("v1_net.pt2", "v2_net.pt2", "v2_net_sc.pt2"):
        assert all("fingerprint" not in op for op in C.manifest_of(FIXTURES_DIR / fixture)["ops"]), fixture
    old = tmp_path / "before_fingerprints.pt2"
    m = C.manifest_of(setup["plain"])
    for op in m["ops"]:
        del op["fingerprint"]
    C.with_manifest(setup["plain"], old, m)
    (r,) = run_cases(setup, "v2_forward", [{"path": str(old), "options": {"allow": ["idmod"]}, "run": X}])
    assert r["error"] is None and r["value"] == 3 * (3 + 3), r  # v2's forward, not the saved one
    doc = (REPO_DIR / "docs" / "shipping.md").read_text()
    identity = next(line for line in doc.splitlines() if line.startswith("| **loading: identity**"))
    assert "archives written before fingerprints were recorded carry none: nothing is compared" in identity


def test_function_changed_must_be_one_of_the_choices(setup):
    import torch_opaque

    with pytest.raises(ValueError, match="function_changed must be one of 'error', 'run_process', 'run_stored'"):
        torch_opaque.load(setup["sc"], function_changed="newest")


def _factory(scale, table):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale + table[0]

        @staticmethod
        def backward(ctx, g):
            return g * scale

    return F


def test_fingerprints_follow_code_closures_and_defaults():
    a, b = _factory(2.0, (1,)), _factory(2.0, (1,))
    assert function_fingerprint(a) == function_fingerprint(b)  # the same definition
    assert function_fingerprint(a) != function_fingerprint(_factory(3.0, (1,)))
    assert function_fingerprint(a) != function_fingerprint(_factory(2.0, (2,)))
    t1, t2 = _factory(torch.ones(3), (0,)), _factory(torch.ones(3) * 2, (0,))
    assert function_fingerprint(t1) != function_fingerprint(t2)  # closed-over tensors by value

    class Sub(a):  # inherits forward, overrides backward
        @staticmethod
        def backward(ctx, g):
            return g

    assert function_fingerprint(Sub) != function_fingerprint(a)
