"""Every operator a loaded program may call, called with hostile arguments.

Note [Admitted operator families] (torch_opaque/archive/admitted_ops.py)
admits an operator only when its kernel checks its arguments. This test holds
the list to that: each admitted overload is called with arguments drawn from
a fixed seed for each case (tests/support/scripts/fuzz_ops.py: indices far
out of range, negative and huge sizes and dims, empty, expanded, transposed
and overlapping tensors, one tensor passed twice, unexpected dtypes), as a
loaded program calls it (a one-node FX graph, after the loader's checks), in
child processes. A signal (SIGSEGV, SIGABRT, SIGBUS, ...) fails the test
naming the overload and the seed; an exception or a result passes. An
operator that crashes is taken off the list (or refused with its reason in
op_policy.py), not skipped here.

Which operators are covered: every overload of every admitted name and of
its in-place form when the family admits one, but the ``out=`` overloads
(refused at load), those torch's dispatcher does not know (TorchScript
builtins: refused at load) and those with ``Dimname`` arguments (named
tensors, which a serialized program cannot hold): COVERED below. A test
checks that each family has overloads that ran and calls that got past the
kernels' checks, so the list and the fuzz cannot drift apart.

Real archives, saved with torch_opaque and loaded by the loader, are run
with hostile indices and crafted size arguments in
test_loaded_programs_with_hostile_indices_raise_cleanly.
"""

from __future__ import annotations

import json
import subprocess
import zlib

import pytest
import torch

import archive_corpus as C
import torch_opaque
from support.processes import run_python
from torch_opaque.archive import admitted_ops
from torch_opaque.archive.op_policy import check_target

CASES_PER_OVERLOAD = 8
BATCH = 4000  # cases per child process
CHILD_CPU_S = 300  # RLIMIT_CPU of one child: a hang fails instead of stalling
CHILD_AS_MIB = 6144  # RLIMIT_AS of one child: a huge allocation raises
ARG_TYPES = {
    "Tensor", "int", "bool", "List[int]", "number", "float", "List[Tensor]", "ScalarType", "Layout",
    "Device", "MemoryFormat", "str", "Generator", "List[bool]", "List[number]", "List[float]",
    "List[Optional[Tensor]]",
}  # fmt: skip


def _dispatcher_has(ns: str, name: str, overload: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{ns}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        return False
    return True


def _fuzzable(schema) -> bool:
    if "Dimname" in str(schema):
        return False
    for a in schema.arguments:
        t = str(a.real_type)
        t = t[len("Optional[") : -1] if t.startswith("Optional[") else t
        if t not in ARG_TYPES:
            return False
    return True


def admitted_overloads() -> dict:
    """family name -> the overloads ('ns::name.overload') the fuzz calls."""
    import torch._prims  # noqa: F401  (registers the prims operators)

    out = {}
    for fam in admitted_ops.FAMILIES:
        quals = []
        for op in sorted(fam.ops):
            ns, name = op.split("::") if "::" in op else ("aten", op)
            for n in [name] + ([name + "_"] if fam.in_place else []):
                packet = getattr(getattr(torch.ops, ns), n, None) if hasattr(torch.ops, ns) else None
                if packet is None:
                    continue
                for ov in sorted(packet.overloads()):
                    if not _dispatcher_has(ns, n, ov):
                        continue
                    schema = getattr(packet, ov)._schema
                    if not any(a.is_out for a in schema.arguments) and _fuzzable(schema):
                        quals.append(f"{ns}::{n}.{ov}")
        out[fam.name] = quals
    return out


COVERED = admitted_overloads()


def _died(rc) -> str:
    import signal

    if isinstance(rc, int) and rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with status {rc}"


def _run_batch(cases: list, tmp_path) -> dict:
    """case id -> result; a case the child died in gets 'died: ...', and the
    rest run in a fresh child."""
    results = {}
    todo = list(cases)
    while todo:
        spec = tmp_path / f"fuzz_{len(list(tmp_path.iterdir()))}.json"
        spec.write_text(json.dumps(todo))
        try:
            proc = run_python(script="fuzz_ops.py", args=[spec, CHILD_CPU_S, CHILD_AS_MIB], timeout=900)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode(errors="replace"), "", "timeout"
        started = None
        for line in out.splitlines():
            if line.startswith("START "):
                started = json.loads(line[6:])
            elif line.startswith("CASE "):
                case_id, result = json.loads(line[5:])
                results[case_id] = result
                started = None
        left = [c for c in todo if c[0] not in results]
        if not left and rc == 0:
            break
        assert started is not None, f"the fuzz child {_died(rc)} outside a case:\n{out[-1000:]}\n{err[-3000:]}"
        results[started] = f"died: the child {_died(rc)}; stderr ends {err[-300:]!r}"
        todo = [c for c in left if c[0] != started]
    return results


@pytest.fixture(scope="module")
def fuzz_results(tmp_path_factory) -> dict:
    """(family, overload, seed) -> result of each case."""
    cases, key = [], {}
    for fam, quals in COVERED.items():
        for qual in quals:
            for i in range(CASES_PER_OVERLOAD):
                seed = zlib.crc32(qual.encode()) * 16 + i
                key[len(cases)] = (fam, qual, seed)
                cases.append([len(cases), qual, seed])
    tmp = tmp_path_factory.mktemp("op_fuzz")
    results = {}
    for start in range(0, len(cases), BATCH):
        results.update(_run_batch(cases[start : start + BATCH], tmp))
    return {key[i]: r for i, r in results.items()}


def test_admitted_operators_survive_hostile_arguments(fuzz_results):
    died = sorted(f"{qual} (seed {seed}, {fam}): {r}" for (fam, qual, seed), r in fuzz_results.items() if r.startswith("died"))
    assert not died, "admitted operators that crash on hostile arguments:\n" + "\n".join(died)
    assert len(fuzz_results) == CASES_PER_OVERLOAD * sum(map(len, COVERED.values()))


def test_every_admitted_family_is_fuzzed(fuzz_results):
    """Each family has overloads that ran, and calls that got past the
    kernels' checks (a fuzz whose every call is refused would prove nothing)."""
    for fam in admitted_ops.FAMILIES:
        assert COVERED[fam.name], f"no overload of the family {fam.name!r} is fuzzed"
        mine = [r for (f, _, _), r in fuzz_results.items() if f == fam.name]
        assert mine and "ok" in mine, (fam.name, sorted(set(mine)))
        errors = {r for r in mine if r not in ("ok", "refused")}
        if fam.name == "effect tokens":  # they read no argument: nothing to refuse
            continue
        assert errors, f"no call of the family {fam.name!r} had hostile enough arguments to raise"
    ran_ok = {qual for (_, qual, _), r in fuzz_results.items() if r == "ok"}
    # most overloads are reached past their argument checks at least once
    assert len(ran_ok) > 0.6 * sum(map(len, COVERED.values())), len(ran_ok)


def test_each_admitted_operator_is_in_one_family_and_exists():
    seen = {}
    for fam in admitted_ops.FAMILIES:
        assert fam.why and "\n" not in fam.why and len(fam.why) < 200, fam.name
        for op in fam.ops:
            assert op not in seen, f"{op} is in the families {seen[op]!r} and {fam.name!r}"
            seen[op] = fam.name
            ns, name = op.split("::") if "::" in op else ("aten", op)
            assert admitted_ops.family_of(ns, name) is fam
            why = check_target(f"torch.ops.{ns}.{name}.default", lambda t: False)
            assert why is None or "not a dispatcher operator" in why, (op, why)  # no default overload
    assert sum(map(len, COVERED.values())) > 1000  # the overloads the fuzz calls


def test_operators_outside_the_families_are_refused_with_the_way_on():
    for target, why in [
        ("torch.ops.aten.cudnn_convolution.default", "not one of the operators a loaded program may call"),
        ("torch.ops.aten._fft_r2c.default", "indexes memory with values from its arguments"),
        ("torch.ops.aten.embedding_bag.padding_idx", "indexes memory with values from its arguments"),
        ("torch.ops.aten.add.out", "an out= overload"),
        ("torch.ops.aten.replication_pad2d_backward.grad_input", "an out= overload"),
        ("torch.ops.aten.from_file.default", "reads or writes files"),
        ("torch.ops.aten.sin_.default", None),
        ("torch.ops.aten.transpose_.default", "not one of the operators"),  # no in-place form for views
    ]:
        got = check_target(target, lambda t: False)
        if why is None:
            assert got is None, (target, got)
            continue
        assert got is not None and why in got, (target, got)
        if "not one of" in why:
            assert "docs/shipping.md#admitted-operators" in got and "allow=[...]" in got and "file an issue" in got


def test_the_docs_list_the_admitted_families():
    from support.processes import REPO_DIR

    doc = (REPO_DIR / "docs" / "shipping.md").read_text()
    start, end = "<!-- admitted families: start -->\n", "\n<!-- admitted families: end -->"
    shown = doc[doc.index(start) + len(start) : doc.index(end)]
    assert shown == admitted_ops.family_table_markdown(), (
        "docs/shipping.md's table of admitted families is not admitted_ops.family_table_markdown()"
    )


# ---- real archives: saved by torch_opaque, loaded by the loader, run with hostile values ------

class _Indexing(torch.nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.table = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, idx, x):
        if self.how == "embedding":
            return torch.nn.functional.embedding(idx, self.table)
        if self.how == "index_select":
            return x.index_select(0, idx)
        if self.how == "gather":
            return x.gather(0, idx.unsqueeze(1).expand(-1, 4))
        if self.how == "scatter":
            return x.scatter(0, idx.unsqueeze(1).expand(-1, 4), 1.0)
        if self.how == "index":
            return x[idx]
        if self.how == "index_put":
            return x.index_put((idx,), torch.ones(4))
        if self.how == "index_add":
            return x.index_add(0, idx, torch.ones(idx.shape[0], 4))
        if self.how == "take":
            return x.take(idx)
        if self.how == "nll_loss":
            return torch.nn.functional.nll_loss(x[: idx.shape[0]].log_softmax(1), idx)
        raise AssertionError(self.how)


INDEXING = ["embedding", "index_select", "gather", "scatter", "index", "index_put", "index_add", "take", "nll_loss"]
HOSTILE_INDICES = [[1 << 40, 0, 1], [-(1 << 40), 0, 1], [40, 0, 1], [-41, 0, 1], [(1 << 63) - 1, 0, 1]]

RUN_HOSTILE = r"""
import json, sys, torch, torch_opaque
for path, indices in json.loads(sys.argv[1]):
    ep = torch_opaque.load(path)
    for idx in indices:
        print("START " + json.dumps([path, idx]), flush=True)
        try:
            ep.module()(torch.tensor(idx), torch.randn(10, 4))
            got = "ok"
        except Exception as e:
            got = type(e).__name__
        print("CASE " + json.dumps([path, idx, got]), flush=True)
"""


def _set_arg(target: str, arg: str, value: dict):
    """A model edit: the argument `arg` (a serialized Argument, {"as_int": 5})
    of the first call of `target`."""

    def edit(model):
        for node in C.graph_of(model)["nodes"]:
            if node["target"] == target:
                for inp in node["inputs"]:
                    if inp["name"] == arg:
                        inp["arg"] = value
                        return
        raise AssertionError((target, arg))

    return C.edit_json("/models/model.json", edit)


class _Shapes(torch.nn.Module):
    def forward(self, idx, x):
        return x.select(0, 2).sum() + x.narrow(1, 1, 2).sum() + x.unsqueeze(0).sum() + x.repeat(2, 1).sum() + idx.sum()


def test_loaded_programs_with_hostile_indices_raise_cleanly(tmp_path):
    """Programs saved with torch_opaque.save and loaded by torch_opaque.load
    in a child: each indexing op run with indices far past the tensor, just
    past it, and negative; and a program whose int arguments the file sets
    huge (select's index, narrow's start, unsqueeze's dim, repeat's sizes).
    Every call raises or returns; none kills the child."""
    idx, x = torch.tensor([1, 2, 3]), torch.randn(10, 4)
    runs = []
    for how in INDEXING:
        p = tmp_path / f"{how}.pt2"
        torch_opaque.save(torch.export.export(_Indexing(how), (idx, x)).run_decompositions(), p)
        runs.append([str(p), HOSTILE_INDICES])
    shapes = tmp_path / "shapes.pt2"
    torch_opaque.save(torch.export.export(_Shapes(), (idx, x)).run_decompositions(), shapes)
    for target, arg in [("torch.ops.aten.select.int", "index"), ("torch.ops.aten.slice.Tensor", "start"),
                        ("torch.ops.aten.unsqueeze.default", "dim"), ("torch.ops.aten.repeat.default", "repeats")]:
        for value in (1 << 40, -(1 << 62), (1 << 63) - 1):
            p = tmp_path / f"shapes_{target.split('.')[3]}_{value}.pt2"
            arg_value = {"as_ints": [value, 1]} if arg == "repeats" else {"as_int": value}
            C.rewrite(shapes, p, _set_arg(target, arg, arg_value))
            runs.append([str(p), [[0, 1, 2]]])
    proc = run_python(RUN_HOSTILE, args=[json.dumps(runs)], timeout=600)
    done = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert proc.returncode == 0, f"the child {_died(proc.returncode)} after {done[-1:]}:\n{proc.stderr[-3000:]}"
    assert len(done) == sum(len(i) for _, i in runs)
    results = {(p.rsplit("/", 1)[-1], tuple(i)): got for p, i, got in done}
    for how in INDEXING:
        for i in HOSTILE_INDICES:
            assert results[(f"{how}.pt2", tuple(i))] in ("IndexError", "RuntimeError"), (how, i, results)
    crafted = {k: v for k, v in results.items() if k[0].startswith("shapes_")}
    assert len(crafted) == 12 and "ok" not in {v for k, v in crafted.items() if "unsqueeze" in k[0] or "select" in k[0]}, crafted

