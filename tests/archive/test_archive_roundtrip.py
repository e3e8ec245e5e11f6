"""The round-trip property test (issue 36): every Function of the corpus
(tests/roundtrip_corpus.py) goes through each path a program takes, and one
training step of the result is compared with the eager stock Function's
(outputs, which outputs require grad, the custom gradients of inputs and
parameters; tests/support/scripts/roundtrip_loss.py).

Paths (one test per case and path):

* ``archive``: ``torch_opaque.export`` (auto()), ``torch_opaque.save(...,
  self_contained=True)``, and ``torch_opaque.load`` in a fresh process that
  cannot import the corpus (all cases in one process, a fresh one after a
  crash: tests/support/scripts/load_roundtrip_cases.py);
* ``stock``: the same program through ``torch.export.save`` / ``load`` here,
  where the ops are registered (what torch's own serializer carries);
* ``onnx``: ``torch_opaque.onnx.export`` of the program, run by ONNX Runtime
  (outputs; for random ops, whose numbers ONNX Runtime draws its own way,
  shapes and dtypes only);
* ``training``: ``torch_opaque.export_training`` under auto(), its loss and
  gradients.
"""

from __future__ import annotations

import pytest
import torch

import archive_corpus as C
import roundtrip_corpus as R
import torch_opaque
import torch_opaque.onnx
from torch_opaque import passes
from support.scripts.roundtrip_loss import close, compare, loss, step

PATHS = ("archive", "stock", "onnx", "training")

# Note [Round-trip cases waiting for sibling fixes]
# Cases that fail today because of rows of issue 36 that other branches fix
# (issue-36a: grad-mode regions and higher-order ops in stored programs;
# issue-36c: the state backward programs are traced in, list-of-tensors
# arguments, backwards that cannot be traced). Each is a strict xfail: when
# the fix lands, the case passes, the xfail fails, and the entry goes.
SIBLING_ROWS: dict = {  # (the fixed cases left this list when their branches landed)
    # save refuses its own archive: the manifest cannot write a Function's list state token
    ("list of tensors", "archive"): "issue-36: a list in ctx state of a self-contained save",
    # export_training runs the backward in the caller's grad mode (docs/limits.md)
    ("backward refuses grad mode", "training"): "a training step runs the backward with grad mode on",
}

# Failures for other reasons, not fixed yet (each in docs/limits.md).
_AUTO_REFUSES = "auto() refuses ctx state the backward would get back as another type (Function stays stock)"
_NO_GRAD_OUTPUT = "export_training: torch refuses an input that requires grad and gets none (pytorch#101192)"
KNOWN: dict = {
    **{(name, path): _AUTO_REFUSES for name in ("ctx: numpy scalars", "ctx: Enum", "ctx: IntEnum", "ctx: dict")
       for path in PATHS},
    ("None gradient for an input that requires grad", "training"): _NO_GRAD_OUTPUT,
    ("list of tensors", "training"): _NO_GRAD_OUTPUT,
    ("random: a seeded torch.Generator", "archive"): "a torch.Generator constant is a pickled object: refused by load",
    ("random: a seeded torch.Generator", "onnx"): "torch.onnx cannot translate a torch.Generator constant",
    ("autocast: custom_fwd(cast_inputs)", "archive"): "a stored op does not autocast its inputs (dtype mismatch)",
    ("autocast: matmul in forward", "archive"): "a stored op does not autocast its inputs (dtype mismatch)",
    ("autocast: custom_fwd(cast_inputs)", "onnx"): "ONNX Runtime's CPU provider has no bfloat16 MatMul",
    ("autocast: matmul in forward", "onnx"): "ONNX Runtime's CPU provider has no bfloat16 MatMul",
}  # fmt: skip


def params():
    out = []
    for name in R.BUILDERS:
        for path in PATHS:
            why = SIBLING_ROWS.get((name, path)) or KNOWN.get((name, path))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(name, path, id=f"{path}-{name}", marks=marks))
    return out


class Corpus:
    """Each case built, run eagerly and exported once (lazily); the archive
    path's results for all cases at once."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.built: dict = {}
        self.loaded = None

    def get(self, name):
        if name not in self.built:
            try:
                c = R.build(name)
                want = step(c.model, c.run_args, c.grad, c.seed)  # the stock Functions
                ep = torch_opaque.export(c.model, tuple(a for a in c.args), dynamic_shapes=c.dynamic_shapes)
                assert passes.list_opaque_ops(ep), "no opaque op in the program"
                self.built[name] = (c, want, ep)
            except Exception as e:
                self.built[name] = e
        got = self.built[name]
        if isinstance(got, Exception):
            raise got
        return got

    def file(self, name, suffix):
        return self.tmp / f"case{list(R.BUILDERS).index(name)}.{suffix}"

    # ---- the paths

    def archive(self, name):
        if self.loaded is None:
            self.loaded = self._load_all()
        r = self.loaded[name]
        assert "save" not in r, r["save"]
        assert "died" not in r, r["died"]
        for what in ("load", "run"):
            assert r[what][0] == "ok", f"{what}: {r[what][0]}: {r[what][1]}"

    def _load_all(self) -> dict:
        results, todo = {}, []
        for name in R.BUILDERS:
            try:
                c, want, ep = self.get(name)
                path, ref = self.file(name, "pt2"), self.file(name, "ref")
                torch_opaque.save(ep, path, self_contained=True)
                torch.save({"args": c.run_args, "grad": c.grad, "seed": c.seed, "want": want, "atol": c.atol}, ref)
                todo.append((name, path, {"ref": str(ref), "module": R.__name__}))
            except Exception as e:
                results[name] = {"save": f"{type(e).__name__}: {e}"}
        results.update(
            C.run_cases(todo, self.tmp, self.tmp / "marker", script="load_roundtrip_cases.py", with_fixtures=False)
        )
        return results

    def stock(self, name):
        c, want, ep = self.get(name)
        path = self.file(name, "stock.pt2")
        torch.export.save(ep, path)
        compare(step(torch.export.load(path).module(), c.run_args, c.grad, c.seed, want["diff"]), want, c.atol)

    def onnx(self, name):
        import onnxruntime

        c, want, ep = self.get(name)
        proto = torch_opaque.onnx.export(ep)
        sess = onnxruntime.InferenceSession(proto.SerializeToString())
        tensors = [a.numpy() for a in c.run_args if isinstance(a, torch.Tensor)]
        got = sess.run(None, {i.name: t for i, t in zip(sess.get_inputs(), tensors)})
        assert len(got) == len(want["out"]), f"{len(got)} outputs, eager gives {len(want['out'])}"
        for i, (g, w) in enumerate(zip(got, want["out"])):
            g = torch.from_numpy(g)
            if c.seed is not None:  # ONNX Runtime draws its own random numbers
                assert (g.shape, g.dtype) == (w.shape, w.dtype), f"output {i}: {g.shape} {g.dtype}, eager: {w.shape} {w.dtype}"
            else:
                close(f"output {i}", g, w, c.atol)

    def training(self, name):
        c, want, ep = self.get(name)
        args = tuple(a.detach().clone().requires_grad_(g) if g else a for a, g in zip(c.args, c.grad))
        with torch_opaque.auto():
            program = torch_opaque.export_training(
                c.model, args, loss=lambda out: loss(out, want["diff"]), dynamic_shapes=c.dynamic_shapes
            )
        if c.seed is not None:
            torch.manual_seed(c.seed)
        got = program.module()(*c.run_args)
        expected = [want["loss"]]
        expected += [g for n, g in want["param_grads"].items() if dict(c.model.named_parameters())[n].requires_grad]
        expected += [g for g, flag in zip(want["grads"], c.grad) if flag]
        names = torch_opaque.training_outputs(program)
        assert len(got) == len(expected), f"outputs {names}, eager has {len(expected)}"
        for n, g, w in zip(names, got, expected):
            close(n, g, w, c.atol)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus(tmp_path_factory.mktemp("roundtrip"))


def test_corpus_size():
    assert len(R.BUILDERS) >= 40


@pytest.mark.parametrize("name,path", params())
def test_roundtrip(corpus, name, path):
    getattr(corpus, path)(name)


@pytest.mark.parametrize("name", ["saved input", "no_grad in forward", "several Functions, a Linear"])
def test_no_empty_grad_mode_regions(corpus, name):
    """auto()'s first-call checks run on fake tensors with torch-function modes
    off: export's mode does not record their no_grad as an empty
    wrap_with_set_grad_enabled region (which made every such self-contained
    archive unloadable)."""
    _, _, ep = corpus.get(name)
    hops = [n for n in ep.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert not hops, ep.graph
