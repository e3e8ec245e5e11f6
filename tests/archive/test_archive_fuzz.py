"""Fuzzing ``torch_opaque.load`` and ``inspect`` with mutated archives.

Valid archives (archops.export_net(), saved plain and self-contained) are
mutated by hypothesis: a value of the manifest, of a serialized graph or of a
payload config (the graphs and configs inside stored programs too) replaced by,
or extended with, a hostile value (control characters, quotes, code that
creates the marker file, srepr-looking calls, names of dangerous functions and
operators, huge integers, deep nesting, long lists); bytes of an entry flipped;
an entry truncated, dropped, duplicated or renamed; the zip itself flipped or
truncated. Every example is loaded, inspected (and run when it loaded) in a
child interpreter, a batch of examples per child, under an address-space limit
and a CPU-time limit per example (tests/support/scripts/load_and_inspect_cases.py):
no example may crash the child, create the marker, take more than
archive_corpus.STEP_CPU_S of CPU in a step, raise the peak resident size by
more than PEAK_RISE_MIB, or fail with
an error other than a TorchOpaqueError (ArchiveError, OpNotAllowedError,
InspectError).

The examples are derandomized (the same ones on every run) and bounded
(EXAMPLES), so the test takes well under a minute of CPU; set
TORCH_OPAQUE_FUZZ_EXAMPLES=2000 TORCH_OPAQUE_FUZZ_SEED=<n> to search further.
An example's name (in a failure) is its archive and its mutations.
"""

import base64
import copy
import io
import json
import os
import zipfile

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import torch_opaque
import archive_corpus as C
from opaque_fixtures import archops

# load + inspect runs, both archives together; TORCH_OPAQUE_FUZZ_EXAMPLES and
# TORCH_OPAQUE_FUZZ_SEED run more, or others, by hand
EXAMPLES = int(os.environ.get("TORCH_OPAQUE_FUZZ_EXAMPLES", 150))
SEED = os.environ.get("TORCH_OPAQUE_FUZZ_SEED") or None
# Both from the child as it is once torch is imported (Note [Memory measured
# from the imported interpreter]): the address space its examples may add
# (RLIMIT_AS; it was 3 GiB in all when torch's CPU build mapped ~0.9), and how
# far a step may raise its peak resident size (1,024 in all when the imported
# interpreter held ~350 MiB; a bomb would add 1,024).
AS_HEADROOM_MIB = 2048
PEAK_RISE_MIB = 674
CASE_CPU_KILL_S = 30
ALLOW = {"allow": ["opaque_fixtures"]}

# Sentinels json.dumps cannot write themselves, put into the text afterwards.
_BIG = "\x00big\x00"  # a 5000-digit integer
_DEEP = "\x00deep\x00"  # 100k nested lists
_SENTINELS = {json.dumps(_BIG): "9" * 5000, json.dumps(_DEEP): "[" * 100_000 + "]" * 100_000}


def hostile_strings(rel: str, absolute: str) -> list:
    """Strings that, if any part of load or inspect ran them as code (or as
    sympy, an FX name, a guard, a getattr walk), would create the marker."""
    out = []
    for m in (rel, absolute):
        out += [
            f"\r__import__('builtins').open('{m}', 'w')\r",
            f"\n__import__('builtins').open('{m}', 'w')\n",
            f"y=open('{m}', 'w')",
            f'x"); open("{m}", "w"); ("',
            f"x') if open('{m}', 'w') else ('",
            f"k = open('{m}', 'w'), j",
            f"S('Integer.__new__.__builtins__.get')('open')('{m}', 'w')",
            f"S('__import__(\"builtins\").open(\"{m}\", \"w\")')",
            f"Symbol('s0') + S('__import__(\"os\").system(\"touch {m}\")')",
            f"__import__('os').system('touch {m}')",
            f"L['x'].size()[0] > 3 or open('{m}', 'w')",
            f"eval(\"open('{m}', 'w')\")",
        ]
    out += [
        "torch.os.system", "os.system", "posix.system", "builtins.eval", "builtins.exec",
        "subprocess.Popen", "torch.ops.aten.from_file.default", "torch.ops.aten.set_.source_Tensor",
        "torch.ops.aten.fill_.Scalar", "torch.ops.profiler._record_function_enter_new.default",
        "torch.ops.higher_order.wrap", "torch.ops.higher_order.print", "torch.ops.aten.sin.default",
        "torch.ops.opaque.ArchCube.Tensor", "_operator.getitem", "torch.sym_max",
        "Pow(Integer(9), Pow(Integer(9), Integer(9)))", "9**9**9", "Integer(" + "9" * 100 + ")",
        "Symbol('s0', integer=True, positive=True)", "Symbol('__class__')", "oo", "zoo",
        "opaque_fixtures.archops", "os", "__main__", "Cube", "ScaledSin.__init__.__globals__",
        "", " ", "\x00", "\x1b[2J\x1b]8;;http://x\x07", "\u202e", "\ud800", "..", "../../x", "/etc/passwd",
        "a" * 100_000, "float32", "cpu", "cuda:9999", "Tensor", "torch_opaque.program.99.fwd",
        "opaque::X.Y(Tensor x) -> Tensor", "Tensor(a!) x", "__import__",
    ]  # fmt: skip
    return out


def hostile_values(strings: list):
    ints = st.sampled_from(
        [0, -1, 1, 3, 7, 255, 1 << 31, (1 << 63) - 1, 1 << 63, -(1 << 63) - 1, 1 << 64, 10**30, _BIG]
    ) | st.integers(-3, 10)
    floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 0.5])
    other = st.sampled_from(
        [
            None, True, False, [], {}, _DEEP, [0] * 100_000, [[[[["x"]]]]],
            {"as_operator": "torch.os.system"}, {"as_operator": "torch.ops.aten.from_file.default"},
            {"as_string": "marker"}, {"as_int": _BIG}, {"as_expr": {"expr_str": "9**9**9"}},
            {"dtype": "os"}, {"eval": "1"}, {"float": "1e999"}, {"device": "cpu; rm"},
            {"name": "x\ropen('marker', 'w')"}, {"as_tensor": {"name": "nope"}},
            {"as_graph": {"name": "g", "graph": {}}}, {"user_input_mutation": {"arg": {"name": "x"}, "user_input_name": "x"}},
        ]
    )  # fmt: skip
    return st.one_of(st.sampled_from(strings), st.text(max_size=12), ints, floats, other)


# ---- the archives and what can be mutated in them -----------------------------------------------


def json_paths(obj, prefix=()) -> list:
    """Every path (tuple of keys / indices) of a JSON document, the root included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, prefix + (i,))
    return out


def dumps(obj) -> bytes:
    text = json.dumps(obj)
    for k, v in _SENTINELS.items():
        text = text.replace(k, v)
    return text.encode("utf-8", errors="surrogatepass")


class Base:
    """A valid archive: its entries, and for each JSON document in it (a
    stored program's included) the paths a mutation can reach."""

    def __init__(self, path):
        self.path = path
        self.entries = C.read_entries(path)
        self.docs = {}  # (entry name, inner entry name or None) -> (document, paths)
        for e in self.entries:
            if e.name.endswith(".json"):
                doc = json.loads(e.data)
                self.docs[(e.name, None)] = (doc, json_paths(doc))
            elif "/extra/torch_opaque.program." in e.name:
                for ie in C.read_entries(io.BytesIO(base64.b64decode(e.data))):
                    if ie.name.endswith(".json"):
                        doc = json.loads(ie.data)
                        self.docs[(e.name, ie.name)] = (doc, json_paths(doc))
        self.doc_keys = sorted(self.docs, key=lambda k: (k[0], k[1] or ""))
        # the paths of the values that reach code in torch's deserializer (a
        # mutation picks among them half of the time)
        self.hot = [(k, p) for k in self.doc_keys for p in self.docs[k][1] if _is_hot(p)]
        # the string values among them, by their key ('expr_str', 'name', ...),
        # so that each kind of value is as likely to be hit
        groups: dict = {}
        for k, p in self.hot:
            if isinstance(_get(self.docs[k][0], p), str):
                key = next(x for x in reversed(p) if isinstance(x, str))
                groups.setdefault(key, []).append((k, p))
        self.hot_strings = [groups[g] for g in sorted(groups)]


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


# keys whose values torch turns into code, looks up, or sizes things by
_HOT_KEYS = {
    "name", "target", "expr_str", "as_operator", "as_string", "as_int", "as_ints", "guards_code",
    "parameter_name", "buffer_name", "tensor_constant_name", "forward_arg_names", "user_input_name",
    "in_spec", "out_spec", "fqn", "path_name", "use_pickle", "sizes", "strides", "storage_offset",
    "dtype", "layout", "module", "class", "schema", "arguments", "overload", "namespace", "tokens",
    "fwd", "bwd", "saved", "grads", "n_out", "variants", "value", "kind", "range_constraints",
}  # fmt: skip


def _is_hot(path) -> bool:
    return any(isinstance(k, str) and k in _HOT_KEYS for k in path[-3:])


def _edit_json(doc, path, op: str, value, other_key: str):
    """The document with `op` applied at `path` (a copy)."""
    doc = copy.deepcopy(doc)
    if not path:
        return value if op in ("replace", "extend") else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    cur = parent[key]
    if op == "replace":
        parent[key] = value
    elif op == "extend":  # keeps the structure: 'x' -> 'x' + hostile, [..] + [hostile]
        if isinstance(cur, str) and isinstance(value, str):
            parent[key] = cur + value
        elif isinstance(cur, list):
            cur.append(value)
        elif isinstance(cur, dict):
            cur[other_key] = value
        else:
            parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(cur))
        else:
            parent[other_key] = copy.deepcopy(cur)
    return doc


def _rezip(entries) -> bytes:
    buf = io.BytesIO()
    C.write_zip(buf, entries)
    return buf.getvalue()


def apply(base: Base, mutations: list) -> bytes:
    """The archive's bytes after the mutations (each a tuple; see `mutation`)."""
    entries = list(base.entries)
    raw_edits = []
    for m in mutations:
        kind = m[0]
        if kind in ("json", "inject"):
            if kind == "json":
                _, hot, k, p, op, value, other_key = m
            else:  # a hostile string for a string that reaches code
                _, g, k, value, op = m
                hot, other_key = None, ""
            if hot is None:
                group = base.hot_strings[g % len(base.hot_strings)]
                (outer, inner), path = group[k % len(group)]
            elif hot:
                (outer, inner), path = base.hot[k % len(base.hot)]
            else:
                outer, inner = base.doc_keys[k % len(base.doc_keys)]
                paths = base.docs[(outer, inner)][1]
                path = paths[p % len(paths)]
            i = next((j for j, e in enumerate(entries) if e.name == outer), None)
            # (an earlier mutation may have dropped, renamed or broken the entry,
            # or removed the path: this one is then skipped)
            if i is None:
                continue
            try:
                if inner is None:
                    doc = json.loads(entries[i].data)
                else:
                    inner_entries = C.read_entries(io.BytesIO(base64.b64decode(entries[i].data)))
                    doc = json.loads(next(ie.data for ie in inner_entries if ie.name == inner))
                data = dumps(_edit_json(doc, path, op, value, other_key))
            except (ValueError, KeyError, IndexError, TypeError, StopIteration, zipfile.BadZipFile):
                continue
            if inner is None:
                entries[i] = C.stored(outer, data)
            else:
                inner_entries = [C.stored(ie.name, data) if ie.name == inner else ie for ie in inner_entries]
                entries[i] = C.stored(outer, base64.b64encode(_rezip(inner_entries)))
        elif kind in ("flip", "truncate", "drop", "duplicate", "rename"):
            i = m[1] % len(entries)
            e = entries[i]
            if kind == "flip":
                data = bytearray(e.data)
                for pos, x in m[2]:
                    if data:
                        data[pos % len(data)] ^= x
                entries[i] = C.stored(e.name, bytes(data))
            elif kind == "truncate":
                entries[i] = C.stored(e.name, e.data[: len(e.data) * m[2] // 100])
            elif kind == "drop":
                del entries[i]
                if not entries:
                    entries = [C.stored("net/x", b"")]
            elif kind == "duplicate":
                entries.append(C.stored(e.name, e.data))
            else:
                entries[i] = C.stored(m[2], e.data)
        else:  # "file_flip" / "file_truncate": the zip's own bytes
            raw_edits.append(m)
    data = _rezip(entries)
    for m in raw_edits:
        if not data:
            break
        if m[0] == "file_flip":
            b = bytearray(data)
            for pos, x in m[1]:
                b[len(b) - 1 - pos % len(b) if pos % 2 else pos % len(b)] ^= x  # the tail holds the directory
            data = bytes(b)
        else:
            data = data[: len(data) * m[1] // 100]
    return data


def mutation(strings):
    values = hostile_values(strings)
    index = st.integers(0, 1 << 16)
    flips = st.lists(st.tuples(index, st.integers(1, 255)), min_size=1, max_size=6)
    names = st.sampled_from(["../../x", "/abs", "net/models/other.json", "net\\x", "net/extra/torch_opaque.json",
                             "net/data/weights/weight_0", "other/x", "net/a\x00b", ""])  # fmt: skip
    payloads = st.sampled_from([x for x in strings if "marker" in x])
    inject = st.tuples(st.just("inject"), index, index, payloads | st.sampled_from(strings),
                       st.sampled_from(["replace", "extend"]))  # fmt: skip
    return st.one_of(
        inject,
        inject,
        st.tuples(st.just("json"), st.booleans(), index, index, st.sampled_from(["replace", "extend", "extend", "delete", "duplicate"]),
                  values, st.sampled_from(strings + ["x", "name", "target", "expr_str"])),  # fmt: skip
        st.tuples(st.just("flip"), index, flips),
        st.tuples(st.just("truncate"), index, st.integers(0, 99)),
        st.tuples(st.sampled_from(["drop", "duplicate"]), index),
        st.tuples(st.just("rename"), index, names),
        st.tuples(st.just("file_flip"), flips),
        st.tuples(st.just("file_truncate"), st.integers(0, 99)),
    )


def describe(mutations) -> str:
    def short(v):
        r = repr(v)
        return r if len(r) <= 90 else r[:60] + f"...({len(r)} chars)"

    return "; ".join("(" + ", ".join(short(x) for x in m) + ")" for m in mutations)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_base")
    ep = archops.export_net()
    torch_opaque.save(ep, d / "net.pt2")
    torch_opaque.save(ep, d / "net_sc.pt2", self_contained=True)
    return {"net": Base(d / "net.pt2"), "sc": Base(d / "net_sc.pt2")}


def test_mutated_archives(bases, tmp_path):
    marker = tmp_path / "marker"
    strings = hostile_strings(marker.name, str(marker))
    cases = []

    @settings(
        max_examples=EXAMPLES, derandomize=SEED is None, database=None, deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(which=st.sampled_from(["net", "sc"]), mutations=st.lists(mutation(strings), min_size=1, max_size=2))
    def collect(which, mutations):
        k = len(cases)
        p = tmp_path / f"ex_{k}.pt2"
        p.write_bytes(apply(bases[which], mutations))
        opts = ALLOW if which == "net" else {}
        cases.append((f"#{k} {which}: {describe(mutations)}", p, opts, C.ANY, C.ANY))

    if SEED is not None:
        collect = seed(int(SEED))(collect)
    collect()
    assert len(cases) >= EXAMPLES * 0.9, len(cases)
    results = {}
    # Self-contained archives in an interpreter that imports nothing (their ops
    # come from the stored programs), the others allowing the defining module.
    for batch in ([c for c in cases if not c[2]], [c for c in cases if c[2]]):
        results.update(
            C.run_cases(batch, tmp_path, marker, case_cpu_kill_s=CASE_CPU_KILL_S, as_headroom_mib=AS_HEADROOM_MIB)
        )
    failures = C.check_results(cases, results, PEAK_RISE_MIB)
    counts = {}
    for r in results.values():
        for what in ("load", "inspect"):
            if what in r:
                outcome = "ok" if r[what][0] == "ok" else "refused" if r[what][2] else "other error"
                counts[(what, outcome)] = counts.get((what, outcome), 0) + 1
    cpu = sum(r.get(w + "_cpu_s", 0) for r in results.values() for w in ("load", "inspect", "run"))
    print(
        f"\n{len(cases)} mutated archives; "
        + ", ".join(f"{w} {o}: {n}" for (w, o), n in sorted(counts.items()))
        + f"; {cpu:.0f} s of CPU in load/inspect/run"
    )
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    assert not marker.exists()
