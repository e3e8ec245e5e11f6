"""An archive never changes a Function the loading process owns (Note [Archive
claims] in torch_opaque/_impl/function.py).

A manifest says how many outputs each op has, whether the Function returns a
tuple and which outputs are modified arguments. For a Function the process has
imported (wrapped) but not called yet, loading defines its op from those
values; they must not change what the user's own ``Cls.apply`` returns: it
gives what stock autograd.Function gives. A claim that contradicts the
Function (its return annotation, overloads the process already has, or its
forward run on fake tensors: Note [The caller's own ops] in
torch_opaque/archive/own_ops.py) refuses the archive at load, naming the
archive, the op and the field, before anything is defined.

Every load runs in a fresh process that imported opaque_fixtures.archops and
never called the Function (unless a test calls it first).
"""

import json

import pytest
import torch

import torch_opaque
from archive_corpus import manifest_of, with_manifest
from opaque_fixtures import archops
from support.processes import run_python


class CubePlusOne(torch.nn.Module):
    def forward(self, x):
        return archops.Cube.apply(x) + 1


class HalfPlusOne(torch.nn.Module):
    def forward(self, x):
        return archops.Half.apply(x) + 1


class AddTwice(torch.nn.Module):
    def forward(self, x, y):
        return archops.AddInPlace.apply(x.clone(), y) * 2


def _edited(src, dst, edit):
    m = manifest_of(src)
    edit(m["ops"][0]["overloads"][0])
    with_manifest(src, dst, m)
    return dst


def _returns_tuple(o):
    o["returns_tuple"] = True


def _two_outputs(o):
    o["n_out"], o["returns_tuple"] = 2, True
    o["schema"] = o["schema"].replace("-> Tensor", "-> (Tensor, Tensor)")


def _other_argument_dirty(o):
    """AddInPlace modifies x; the edited archive says it modifies y."""
    o["dirty"] = [[0, 1]]
    o["schema"] = o["schema"].replace("Tensor(a!) x, Tensor y", "Tensor x, Tensor(a!) y")


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    d = tmp_path_factory.mktemp("owned")
    x, y = torch.randn(3), torch.randn(3)
    torch_opaque.save(torch.export.export(CubePlusOne(), (x,)), d / "cube.pt2")
    torch_opaque.save(torch.export.export(HalfPlusOne(), (x,)), d / "half.pt2")
    torch_opaque.save(torch.export.export(AddTwice(), (x, y)), d / "add.pt2")
    out = {"cube": d / "cube.pt2", "half": d / "half.pt2", "add": d / "add.pt2"}
    out["cube_tuple"] = _edited(d / "cube.pt2", d / "cube_tuple.pt2", _returns_tuple)
    out["cube_two"] = _edited(d / "cube.pt2", d / "cube_two.pt2", _two_outputs)
    out["half_tuple"] = _edited(d / "half.pt2", d / "half_tuple.pt2", _returns_tuple)
    out["half_two"] = _edited(d / "half.pt2", d / "half_two.pt2", _two_outputs)
    out["add_y"] = _edited(d / "add.pt2", d / "add_y.pt2", _other_argument_dirty)
    assert manifest_of(out["add"])["ops"][0]["overloads"][0]["dirty"] == [[0, 0]]
    return out


# The child: for each (archive, Function) job, loads the archive, then calls the
# Function through its own apply and through stock autograd.Function.apply, and
# reports both. The jobs' Functions are distinct: each is not called before its
# load (unless call_first).
CHILD = r"""
import json, sys, warnings
import torch, torch_opaque
from torch_opaque._impl.function import _ORIGINAL_APPLY
from opaque_fixtures import archops

jobs, call_first, trace = json.loads(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"


def run(Cls, apply):
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3)
    if Cls is archops.AddInPlace:
        a, b = x * 1, y.clone()
        try:
            out = apply(Cls, a, b)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e),
                    "args_unchanged": torch.equal(a, x) and torch.equal(b, y)}
        res = {"is_a": out is a, "is_b": out is b, "a": a.tolist(), "b": b.tolist()}
    else:
        try:
            out = apply(Cls, x)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
        res = {}
    res["type"] = type(out).__name__
    t = out[0] if isinstance(out, tuple) else out
    res["len"] = len(out) if isinstance(out, tuple) else None
    res["value"] = t.tolist()
    t.sum().backward()
    res["grad"] = x.grad.tolist()
    return res


def own(C, *a):
    return C.apply(*a)


def job(path, name):
    Cls = getattr(archops, name)
    report = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call_first:
            report["before"] = run(Cls, own)
        try:
            ep = torch_opaque.load(path)
            report["load_error"] = None
        except Exception as e:
            ep = None
            report["load_error"] = {"error": type(e).__name__, "message": str(e)}
        report["ours"] = run(Cls, own)
        report["ours_again"] = run(Cls, own)
        if trace and "error" not in report["ours"]:
            class M(torch.nn.Module):
                def forward(self, x):
                    return Cls.apply(x) * 2
            x = torch.randn(3)
            report["export"] = type(torch.export.export(M(), (x,)).module()(x)).__name__
            compiled = torch.compile(M(), backend="eager", fullgraph=True)
            report["compile"] = type(compiled(x)).__name__
        if ep is not None and name != "AddInPlace":
            x = torch.randn(3)
            want = x**3 + 1 if name == "Cube" else x * 0.5 + 1
            try:
                report["program"] = torch.allclose(ep.module()(x), want)
            except Exception as e:
                report["program"] = f"{type(e).__name__}: {e}"
    report["warnings"] = [str(w.message) for w in caught if "torch_opaque" in str(w.message)]
    report["stock"] = run(Cls, _ORIGINAL_APPLY)
    return report


print(json.dumps([job(path, name) for path, name in jobs]))
"""


def child(jobs, call_first=False, trace=False) -> list:
    """One report per (archive, Function name) job, all in one fresh process."""
    arg = json.dumps([[str(path), name] for path, name in jobs])
    proc = run_python(CHILD, args=[arg, int(call_first), int(trace)], with_fixtures=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_names(message: str, *parts) -> None:
    for p in parts:
        assert str(p) in message, (p, message)


def test_returns_tuple_claim_is_refused_at_load(archives):
    """Note [The caller's own ops]: Cube has no return annotation, so its
    forward runs on fake tensors while loading, and the claim is refused
    before anything is defined. (Before: Cube.apply(x) returned a 1-tuple after
    the load, in eager calls, torch.export and torch.compile; then: loaded,
    corrected by the first call with a warning.)"""
    path = archives["cube_tuple"]
    (r,) = child([(path, "Cube")], trace=True)
    err = r["load_error"]
    assert err is not None and err["error"] == "ArchiveError"
    assert_names(err["message"], path, "opaque::ArchCube", "returns_tuple=true", "returns_tuple=false",
                 "archops.Cube", "run on fake tensors")
    assert r["ours"] == r["stock"] and r["ours_again"] == r["stock"]
    assert r["stock"]["type"] == "Tensor"
    assert r["export"] == r["compile"] == "Tensor"
    assert r["warnings"] == []


def test_n_out_claim_is_refused_at_load(archives):
    """The op's schema would have the archive's two outputs, which the
    Function's one cannot fill. (Before: loaded, and every Cube.apply(x)
    afterwards raised an ArchiveError.)"""
    path = archives["cube_two"]
    (r,) = child([(path, "Cube")])
    err = r["load_error"]
    assert err is not None and err["error"] == "ArchiveError"
    assert_names(err["message"], path, "opaque::ArchCube", "n_out=2", "n_out=1", "archops.Cube")
    assert r["ours"] == r["stock"] and r["ours_again"] == r["stock"]
    assert r["stock"]["type"] == "Tensor"


def test_dirty_claim_is_refused_at_load_and_modifies_nothing(archives):
    """(Before: AddInPlace.apply(x, y) returned y and wrote into it; then:
    loaded, and AddInPlace.apply raised.) The conflict with the caller's own op
    is refused before anything is defined, ahead of the undeclared-write check
    (Note [Writes a loaded program may make])."""
    path = archives["add_y"]
    (r,) = child([(path, "AddInPlace")])
    err = r["load_error"]
    assert err is not None and err["error"] == "ArchiveError"
    assert_names(err["message"], path, "opaque::ArchAddInPlace", "dirty=[[0, 1]]", "dirty=[[0, 0]]",
                 "archops.AddInPlace")
    assert r["ours"] == r["stock"]
    assert r["stock"]["is_a"] and not r["stock"]["is_b"]


@pytest.mark.parametrize("case, field", [("half_tuple", "returns_tuple=true"), ("half_two", "n_out=2")])
def test_claims_against_the_return_annotation_are_refused_at_load(archives, case, field):
    """Half's return annotation says one Tensor: known without a call. (Before:
    loaded, then Half.apply(x) returned a tuple / raised.)"""
    (r,) = child([(archives[case], "Half")])
    err = r["load_error"]
    assert err is not None and err["error"] == "ArchiveError"
    assert_names(err["message"], archives[case], "opaque::ArchHalf", field, "archops.Half",
                 "return annotation", "saved from this Function")
    assert r["ours"] == r["stock"]
    assert r["stock"]["type"] == "Tensor"


def test_claims_against_an_overload_the_process_has_are_refused_at_load(archives):
    """Cube was called before the load: the archive's returns_tuple is refused
    before anything is defined. (Before: loaded without a word.)"""
    path = archives["cube_tuple"]
    (r,) = child([(path, "Cube")], call_first=True)
    err = r["load_error"]
    assert err is not None and err["error"] == "ArchiveError"
    assert_names(err["message"], path, "opaque::ArchCube.Tensor", "returns_tuple=true",
                 "returns_tuple=false", "archops.Cube")
    assert r["before"] == r["ours"] == r["stock"]


@pytest.mark.parametrize("call_first", [False, True])
def test_honest_archives_load_and_run_as_stock(archives, call_first):
    jobs = [(archives["cube"], "Cube"), (archives["half"], "Half"), (archives["add"], "AddInPlace")]
    for (_, name), r in zip(jobs, child(jobs, call_first=call_first)):
        assert r["load_error"] is None, name
        assert r["warnings"] == []
        assert r["ours"] == r["stock"] and r["ours_again"] == r["stock"]
        assert "error" not in r["stock"]
        if call_first:
            assert r["before"] == r["stock"]
        if name != "AddInPlace":
            assert r["program"] is True
        else:
            assert r["stock"]["is_a"]


def test_loading_in_this_process_keeps_a_called_functions_overload(archives):
    """The saving process (ops defined by its calls) loads its own archive."""
    ep = torch_opaque.load(archives["cube"])
    x = torch.randn(3)
    assert torch.allclose(ep.module()(x), x**3 + 1)
    with pytest.raises(torch_opaque.errors.ArchiveError, match="returns_tuple=true"):
        torch_opaque.load(archives["cube_tuple"])
    assert isinstance(archops.Cube.apply(x), torch.Tensor)
