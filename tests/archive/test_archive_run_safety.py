"""A loaded program does only what its signature declares when it runs.

Crafted archives, as an attacker would write them, for each class: operators
whose kernels trust their arguments (Note [Operators a loaded program may
call]), writes the signature does not declare (Note [Writes a loaded program
may make]), process state, and weights that are not what their placeholders
say (Note [Weights match their placeholders]). Every case is loaded, inspected
and, when it loads, run in a fresh interpreter (archive_corpus.run_cases): a
crash fails that case, and the others go on in another interpreter.
"""

import pytest
import torch

import archive_corpus as C
import torch_opaque

MODEL = "/models/model.json"
WEIGHTS = "_weights_config.json"


class Sin(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2


class SinOfView(torch.nn.Module):
    def forward(self, x):
        return x.view(-1)[1:3].sin() + 1


class Weighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3))
        self.register_buffer("b", torch.randn(2, 3))
        self.c = torch.randn(2, 3)  # a tensor constant

    def forward(self, x):
        return x * self.w.sin() + self.b.cos() + self.c.tan()


class Mutates(torch.nn.Module):
    """Declared mutations: of its input and of its buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)
        x.mul_(2)
        return x + 1


class Counts(torch.nn.Module):
    """Writes only its own buffer (in place, in the training dialect)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)
        return x + self.n


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(x)


def _retarget(old: str, new: str):
    """A model edit pointing every call of `old` at `new` (its arguments kept)."""

    def edit(model):
        hits = [n for n in C.graph_of(model)["nodes"] if n["target"] == old]
        assert hits, (old, [n["target"] for n in C.graph_of(model)["nodes"]])
        for n in hits:
            n["target"] = new

    return C.edit_json(MODEL, edit)


def _weight_meta(fqn: str, **fields):
    def edit(cfg):
        cfg["config"][fqn]["tensor_meta"].update(fields)

    return C.edit_json(WEIGHTS, edit)


def _constant_meta(fqn: str, **fields):
    def edit(cfg):
        cfg["config"][fqn]["tensor_meta"].update(fields)

    return C.edit_json("_constants_config.json", edit)


def _dtype(name: str) -> int:
    from torch._export.serde.schema import ScalarType

    return int(getattr(ScalarType, name))


def _sizes(*ns):
    return [{"as_int": n} for n in ns]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("run_safety_src")
    x = torch.randn(2, 3)
    out = {}

    def save(name, module, args, decompose=True):
        ep = torch.export.export(module, args)
        torch.export.save(ep.run_decompositions() if decompose else ep, d / f"{name}.pt2")
        out[name] = d / f"{name}.pt2"

    save("sin", Sin(), (x,))
    save("sin_view", SinOfView(), (x,))
    save("weighted", Weighted(), (x,))
    save("weighted_training", Weighted(), (x,), decompose=False)
    save("mutates", Mutates(), (x,))
    save("mutates_training", Mutates(), (x,), decompose=False)
    save("counts_training", Counts(), (x,), decompose=False)
    save("norm", Norm().eval(), (torch.randn(3, 4),))
    save("norm_train", Norm().train(), (torch.randn(3, 4),), decompose=False)
    save("grad", C.GradNet(), (x,))
    return out


def _run(cases, tmp_path):
    """name -> result of each (name, source, entry edit) case."""
    specs = []
    for name, path, edit in cases:
        p = tmp_path / f"{len(specs)}.pt2"
        C.rewrite(path, p, edit) if edit is not None else p.write_bytes(path.read_bytes())
        specs.append((name, p, {}))
    results = C.run_cases(specs, tmp_path, str(tmp_path / "marker"))
    for name, r in results.items():
        assert "died" not in r, f"{name}: the interpreter {r['died']}"
    return results


def _refused(r, *frags):
    kind, msg, ours = r["load"]
    assert kind == "ArchiveError" and ours, r["load"]
    assert msg.startswith("torch_opaque.load:"), msg
    for f in frags:
        assert f in msg, (f, msg)


def _ran(r):
    assert r["load"][0] == "ok", r["load"]
    assert r["run"][0] == "ok", r["run"]


def test_operators_whose_kernels_skip_checks_are_refused(src, tmp_path):
    sin = "torch.ops.aten.sin.default"
    why = "indexes memory with values from its arguments without checking them"
    cases = [
        ("ctc", src["sin"], _retarget(sin, "torch.ops.aten._ctc_loss.default"), why),
        ("ctc public", src["sin"], _retarget(sin, "torch.ops.aten.ctc_loss.IntList"), why),
        ("max-pool backward", src["sin"], _retarget(sin, "torch.ops.aten.max_pool2d_with_indices_backward.default"), why),
        ("embedding backward", src["sin"], _retarget(sin, "torch.ops.aten.embedding_dense_backward.default"), why),
        ("sparse values", src["sin"], _retarget(sin, "torch.ops.aten._values.default"), "sparse tensor from raw parts"),
        ("sparse indices", src["sin"], _retarget(sin, "torch.ops.aten.indices.default"), "sparse tensor from raw parts"),
        ("sparse constructor", src["sin"], _retarget(sin, "torch.ops.aten.sparse_coo_tensor.indices"),
         "sparse tensor from raw parts"),
        ("coalesced flag", src["sin"], _retarget(sin, "torch.ops.aten._coalesced_.default"), "sparse tensor"),
        ("private", src["sin"], _retarget(sin, "torch.ops.aten._cudnn_rnn.default"),
         "not one of the operators a loaded program may call, those whose kernels check their arguments"),
        ("not admitted", src["sin"], _retarget(sin, "torch.ops.aten.max_unpool2d.default"),
         ("not one of the operators a loaded program may call", "allow=[...]", "file an issue")),
        ("quantized", src["sin"], _retarget(sin, "torch.ops.quantized.add.default"), "packed weights"),
        ("mkldnn", src["sin"], _retarget(sin, "torch.ops.mkldnn._convolution_pointwise.default"), "packed weights"),
        ("sparse namespace", src["sin"], _retarget(sin, "torch.ops.sparse.qlinear.default"), "packed weights"),
    ]  # fmt: skip
    results = _run([c[:3] for c in cases], tmp_path)
    for name, _, _, frag in cases:
        _refused(results[name], "is not an operator a loaded program may call", *((frag,) if isinstance(frag, str) else frag))


def test_batch_norm_runs_only_with_one_statistic_per_channel(src, tmp_path):
    """Batch norm's CPU kernels index the running statistics by channel without
    checking their size (a size-1 running_var read past its end, and
    segfaulted in training): the loader checks the sizes the graph records,
    which the weights must match."""

    def one_stat(fqn):
        def edit(model):
            tv = C.graph_of(model)["tensor_values"]
            name = {"bn.running_mean": "b_bn_running_mean", "bn.running_var": "b_bn_running_var",
                    "bn.weight": "p_bn_weight"}[fqn]  # fmt: skip
            tv[name]["sizes"] = _sizes(1)
            tv[name]["strides"] = _sizes(1)

        def both(n, b):
            return _weight_meta(fqn, sizes=_sizes(1), strides=_sizes(1))(n, C.edit_json(MODEL, edit)(n, b))

        return both

    cases = [
        ("eval, running_var", src["norm"], one_stat("bn.running_var")),
        ("eval, weight", src["norm"], one_stat("bn.weight")),
        ("training, running_mean", src["norm_train"], one_stat("bn.running_mean")),
        ("eval, honest", src["norm"], None),
        ("training, honest", src["norm_train"], None),
    ]
    results = _run(cases, tmp_path)
    for name in ("eval, running_var", "eval, weight", "training, running_mean"):
        _refused(results[name], "batch_norm", "not one value per channel of the input (4)")
    _ran(results["eval, honest"])
    _ran(results["training, honest"])  # writes its own running statistics: allowed


def _training(old: str, new: str):
    """_retarget, in a graph that claims the training dialect (whose in-place
    calls torch's ATen verifier would refuse)."""
    retarget = _retarget(old, new)

    def claim(model):
        model["verifiers"] = ["TRAINING"]

    return lambda n, b: C.edit_json(MODEL, claim)(n, retarget(n, b))


def test_writes_the_signature_does_not_declare_are_refused(src, tmp_path):
    sin, sin_ = "torch.ops.aten.sin.default", "torch.ops.aten.sin_.default"
    cos, cos_ = "torch.ops.aten.cos.default", "torch.ops.aten.cos_.default"
    tan, tan_ = "torch.ops.aten.tan.default", "torch.ops.aten.tan_.default"
    user = "a training-dialect program writes a user input in place"
    own = "a loaded program may write only its own buffers in place, not its parameters or constants"
    cases = [
        # an ATen-dialect program is functional: torch's verifier refuses the call itself
        ("user input", src["sin"], _retarget(sin, sin_), ("aten.sin_.default", "is not functional")),
        ("buffer", src["weighted"], _retarget(cos, cos_), ("aten.cos_.default", "is not functional")),
        # the same graphs claiming the training dialect: Note [Writes a loaded program may make]
        ("user input, training", src["sin"], _training(sin, sin_), ("writes to 'x'", user, "run_decompositions()")),
        ("view of a user input, training", src["sin_view"], _training(sin, sin_), ("writes to 'x'", user)),
        ("relu_ through a view, training", src["sin_view"], _training(sin, "torch.ops.aten.relu_.default"),
         ("writes to 'x'", "(its argument 'self')", user)),
        ("parameter, training", src["weighted"], _training(sin, sin_), ("writes to 'w'", own)),
        ("constant, training", src["weighted"], _training(tan, tan_), ("writes to 'c'", own)),
        ("parameter of a training program", src["weighted_training"], _retarget(sin, sin_), ("writes to 'w'", own)),
        ("training program, user input", src["mutates_training"], None, ("writes to 'x'", user)),
    ]  # fmt: skip
    extra = [("declared", src["mutates"], None), ("training, own buffer", src["counts_training"], None)]
    results = _run([c[:3] for c in cases] + extra, tmp_path)
    for name, _, _, frags in cases:
        _refused(results[name], *frags)
    r = results["declared"]
    _ran(r)  # run_decompositions declares both mutations: they are outputs, copied back
    assert r["run_mutated"] is True
    _ran(results["training, own buffer"])


def test_operators_that_change_process_state_are_refused(src, tmp_path):
    sin = "torch.ops.aten.sin.default"
    not_dispatcher = "not a dispatcher operator of torch"
    cases = [
        ("grad mode", src["sin"], _retarget(sin, "torch.ops.aten.set_grad_enabled.default"), not_dispatcher),
        ("manual seed", src["sin"], _retarget(sin, "torch.ops.aten.manual_seed.default"), not_dispatcher),
        ("seed", src["sin"], _retarget(sin, "torch.ops.aten.seed.default"), not_dispatcher),
        ("requires_grad_", src["sin"], _retarget(sin, "torch.ops.aten.requires_grad_.default"),
         "changes the caller's autograd or process state"),
        ("retain_grad", src["sin"], _retarget(sin, "torch.ops.aten.retain_grad.default"), "autograd or process state"),
        ("detach_", src["sin"], _retarget(sin, "torch.ops.aten.detach_.default"), "autograd or process state"),
    ]  # fmt: skip
    results = _run([c[:3] for c in cases] + [("scoped grad mode", src["grad"], None)], tmp_path)
    for name, _, _, frag in cases:
        _refused(results[name], "is not an operator a loaded program may call", frag)
    r = results["scoped grad mode"]  # wrap_with_set_grad_enabled: the HOP scopes it
    _ran(r)
    assert r["state_kept"] is True


def test_weights_and_constants_match_their_placeholders(src, tmp_path):
    w = src["weighted"]
    int32, uint64 = _dtype("INT"), _dtype("UINT64")
    cases = [
        ("weight dtype int32", w, _weight_meta("w", dtype=int32, requires_grad=False), ("parameter 'w'", "dtype torch.int32",
                                                                   "the placeholder says torch.float32")),
        ("weight dtype uint64", w, _weight_meta("w", dtype=uint64, requires_grad=False, sizes=_sizes(1, 3), strides=_sizes(3, 1)),
         ("parameter 'w'", "dtype torch.uint64", "shape (1, 3)")),
        ("buffer shape", w, _weight_meta("b", sizes=_sizes(3, 2), strides=_sizes(2, 1)),
         ("buffer 'b'", "shape (3, 2) (the placeholder says (2, 3))")),
        ("buffer device", w, _weight_meta("b", device={"type": "meta", "index": None}), ("buffer 'b'", "device meta")),
        ("constant dtype", w, _constant_meta("c", dtype=int32), ("constant 'c'", "dtype torch.int32")),
        ("honest", w, None, ()),
    ]  # fmt: skip
    results = _run([c[:3] for c in cases], tmp_path)
    for name, _, _, frags in cases[:-1]:
        _refused(results[name], "does not match its placeholder", *frags)
    _ran(results["honest"])
