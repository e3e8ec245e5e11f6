"""Stored programs are traced in the state eager autograd runs a Function in
(Note [Stored programs run in eager's state] in torch_opaque/archive/trace.py):
each Function of tests/opaque_fixtures/stateops.py is saved self-contained,
loaded in a fresh process that cannot import it, and compared with the eager
stock Function: values, gradients (None where eager gives None), warnings and
errors. The same Functions go through export_training, in process and saved."""

import copy
import warnings

import pytest
import torch

import torch_opaque
from opaque_fixtures import stateops as S
from support.processes import last_json, run_script
from support.stock import stock_functions

FUNCTIONS = (S.PactClip, S.LeakySpike, S.PairScale, S.NoSecondDerivative, S.OnceDiffSoftplus,
             S.RecomputeGelu, S.RecomputeOnSaved, S.ExportFakeQuant, S.WeightedSum)


def stock():
    """The Functions' apply as stock autograd.Function's while inside."""
    return stock_functions(FUNCTIONS)


def _listify(outs):
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def eager_case(model, inputs, requires_grad, loss_weights) -> dict:
    """What the stock Functions compute: outputs, and the gradients of the
    inputs and parameters of the weighted-sum loss (None where eager gives None)."""
    model = copy.deepcopy(model)
    xs = [x.clone().requires_grad_(rg) for x, rg in zip(inputs, requires_grad)]
    with stock():
        outs = _listify(model(*xs))
        loss = sum((o * w).sum() for o, w in zip(outs, loss_weights) if w is not None)
        loss.backward()
    return {
        "kind": "infer", "inputs": list(inputs), "requires_grad": list(requires_grad),
        "loss_weights": list(loss_weights), "out": [o.detach() for o in outs],
        "input_grads": [x.grad for x in xs],
        "param_grads": {n: p.grad for n, p in model.named_parameters()},
    }  # fmt: skip


def weights_for(model, inputs, use=None) -> list:
    with torch.no_grad():
        outs = _listify(copy.deepcopy(model)(*inputs))
    torch.manual_seed(3)
    return [torch.randn_like(o) if use is None or use[k] else None for k, o in enumerate(outs)]


def saved(tmp, name, model, inputs, **export) -> str:
    path = str(tmp / f"{name}.pt2")
    ep = torch.export.export(copy.deepcopy(model), tuple(inputs), **export)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "torch_opaque.save")  # every backward is stored
        torch_opaque.save(ep, path, self_contained=True)
    return path


def spike_inputs():
    torch.manual_seed(2)
    return [torch.randn(3, 4), torch.randn(3, 4)]


def _inference_cases(tmp) -> dict:
    cases = {}
    torch.manual_seed(0)
    x = torch.randn(5, 4)

    # row 2: learnable bounds get a gradient only when they require grad
    pact = S.PactNet()
    cases["pact"] = eager_case(pact, [x], [True], weights_for(pact, [x]))
    cases["pact"]["archive"] = saved(tmp, "pact", pact, [x])

    # row 3: materialize-grads off; one loss per pattern of undefined gradients
    xy = spike_inputs()
    for name, use_mem, use in (("spike_all", True, None), ("spike_spk_a", False, None),
                               ("spike_mem_only", True, (False, True, False)),
                               ("spike_spk_only", True, (True, False, False))):
        net = S.SpikeNet(use_mem)
        torch.manual_seed(0)
        net.fc.reset_parameters()
        cases[name] = eager_case(net, xy, [True, True], weights_for(net, xy, use))
        cases[name]["archive"] = saved(tmp, name, net, xy)

    # row 4: backwards that refuse grad mode
    gm = S.GradModeNet()
    cases["grad_mode"] = eager_case(gm, [x], [True], weights_for(gm, [x]))
    cases["grad_mode"]["archive"] = saved(tmp, "grad_mode", gm, [x])

    # row 5: recompute under enable_grad + autograd.grad
    rc = S.RecomputeNet()
    for name, rg in (("recompute", True), ("recompute_weight_only", False)):
        cases[name] = eager_case(rc, [x], [rg], weights_for(rc, [x]))
        cases[name]["archive"] = saved(tmp, "recompute", rc, [x])

    # row 7: a list-of-tensors argument, two list widths
    fusion = S.FusionNet()
    cases["fusion"] = eager_case(fusion, [x], [True], weights_for(fusion, [x]))
    cases["fusion"]["archive"] = saved(tmp, "fusion", fusion, [x])
    return cases


@pytest.fixture(scope="module")
def quant(tmp_path_factory):
    """Row 6: saved under no_grad, its backward invalid: (archive, warnings, eager)."""
    tmp = tmp_path_factory.mktemp("quant")
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    net = S.QuantNet()
    with torch.no_grad():
        ep = torch.export.export(net, (x,))
    path = str(tmp / "quant.pt2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_opaque.save(ep, path, self_contained=True)
    with stock():
        out = _listify(net(x))
        xg = x.clone().requires_grad_()
        with pytest.raises(RuntimeError) as eager_error:
            S.ExportFakeQuant.apply(xg, net.scale, 8, 8).sum().backward()
    case = {"kind": "infer", "archive": path, "inputs": [x], "requires_grad": [True],
            "out": out, "loss_weights": [torch.ones_like(o) for o in out], "backward_error": True}
    case_no_grad = dict(case, requires_grad=[False], loss_weights=None, backward_error=False)
    return {"quant": case, "quant_inference": case_no_grad}, caught, str(eager_error.value)


def _training_cases(tmp) -> dict:
    """export_training of the same Functions, compared with eager (loss and
    gradients), saved self-contained for the child."""
    cases = {}
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    xy = spike_inputs()
    models = (("train_pact", S.PactNet(), [x]), ("train_spike", S.SpikeNet(False), xy),
              ("train_grad_mode", S.GradModeNet(), [x]), ("train_recompute", S.RecomputeNet(), [x]),
              ("train_fusion", S.FusionNet(), [x]))  # fmt: skip
    for name, model, inputs in models:
        weights = weights_for(model, inputs)

        def loss(outs, weights=weights):
            return sum((o * w).sum() for o, w in zip(_listify(outs), weights))

        ep = torch_opaque.export_training(copy.deepcopy(model), tuple(inputs), loss=loss)
        names = torch_opaque.training_outputs(ep)
        ref = copy.deepcopy(model)
        with stock():
            eager_loss = loss(ref(*inputs))
            eager_loss.backward()
        params = dict(ref.named_parameters())
        want = [eager_loss.detach()] + [params[n].grad for n in names[1:]]
        with torch.no_grad():  # as loss.backward() runs a backward (docs/limits.md)
            got = ep.module()(*inputs)
        assert len(got) == len(want)
        for n, g, w in zip(names, got, want):
            torch.testing.assert_close(g, w, msg=lambda m, n=n: f"{name} {n}: {m}")
        path = str(tmp / f"{name}.pt2")
        torch_opaque.save(ep, path, self_contained=True)
        cases[name] = {"kind": "train", "archive": path, "inputs": inputs, "names": names, "want": want}
    return cases


@pytest.fixture(scope="module")
def child_report(tmp_path_factory, quant):
    tmp = tmp_path_factory.mktemp("state")
    cases = {**_inference_cases(tmp), **quant[0], **_training_cases(tmp)}
    ref = tmp / "ref.pt"
    torch.save(cases, ref)
    report = last_json(run_script("load_compare_state.py", [ref], tmp, with_fixtures=False))
    return report


def test_the_loading_process_cannot_import_the_functions(child_report):
    assert child_report["_imported"] == [] and not child_report["_findable"]


@pytest.mark.parametrize("case", ["pact", "spike_all", "spike_spk_a", "spike_mem_only", "spike_spk_only",
                                  "grad_mode", "recompute", "recompute_weight_only", "fusion"])  # fmt: skip
def test_loaded_program_runs_like_the_eager_function(child_report, case):
    assert child_report[case].get("ok"), child_report[case].get("error")
    assert child_report[case]["warnings"] == []


@pytest.mark.parametrize("case", ["train_pact", "train_spike", "train_grad_mode", "train_recompute",
                                  "train_fusion"])  # fmt: skip
def test_saved_training_step_runs_like_eager(child_report, case):
    assert child_report[case].get("ok"), child_report[case].get("error")


def test_untraceable_backward_saves_the_forward_and_warns_once(quant):
    _, caught, _ = quant
    msgs = [str(w.message) for w in caught if "cannot be traced" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in caught]
    assert "opaque::StateFakeQuant" in msgs[0]
    assert "opaque_fixtures.stateops.ExportFakeQuant" in msgs[0]
    assert "incorrect number of gradients" in msgs[0]
    assert "stores its forward only" in msgs[0]


def test_loaded_forward_runs_and_its_missing_backward_raises_naming_it(child_report, quant):
    assert "incorrect number of gradients" in quant[2]  # eager fails too, when called
    assert child_report["quant_inference"].get("ok"), child_report["quant_inference"].get("error")
    r = child_report["quant"]
    assert r.get("ok"), r.get("error")
    msg = r["backward_error"]
    assert "the backward of opaque::StateFakeQuant" in msg
    assert "opaque_fixtures.stateops.ExportFakeQuant" in msg
    assert "could not be traced" in msg and "incorrect number of gradients" in msg
    assert "holds its forward only" in msg


def test_materialize_and_partial_backwards_are_in_the_manifest(tmp_path):
    import archive_corpus as C

    path = tmp_path / "spike.pt2"
    torch_opaque.save(torch.export.export(S.SpikeNet(True), tuple(spike_inputs())), path,
                      self_contained=True)
    m = C.manifest_of(path)
    ops = {op["name"]: op for op in m["ops"]}
    (variant,) = ops["StatePairScale"]["overloads"][0]["variants"]
    assert variant["materialize"] is False
    assert sorted(p["defined"] for p in variant["partial"]) == [[False, True], [True, False]]
    assert {tuple(p["defined"]): p["grads"] for p in variant["partial"]} == {(True, False): [0], (False, True): [1]}


def test_the_manifest_reader_checks_the_new_records(tmp_path):
    """materialize / partial / bwd_error are read by the closed grammar: a
    pattern that is all true, or a bwd missing without a reason, is refused by field."""
    import archive_corpus as C
    from torch_opaque.errors import ArchiveError

    path = tmp_path / "spike.pt2"
    torch_opaque.save(torch.export.export(S.SpikeNet(True), tuple(spike_inputs())), path,
                      self_contained=True)
    m = C.manifest_of(path)
    k = next(i for i, op in enumerate(m["ops"]) if op["name"] == "StatePairScale")
    variant = m["ops"][k]["overloads"][0]["variants"][0]
    variant["partial"][0]["defined"] = [True, True]
    C.with_manifest(path, tmp_path / "all_true.pt2", m)
    with pytest.raises(ArchiveError, match=rf"ops\[{k}\]\.overloads\[0\]\.variants\[0\]\.partial\[0\]\.defined"):
        torch_opaque.load(tmp_path / "all_true.pt2")
    m = C.manifest_of(path)
    del m["ops"][k]["overloads"][0]["variants"][0]["bwd"]
    C.with_manifest(path, tmp_path / "no_bwd.pt2", m)
    with pytest.raises(ArchiveError, match=r"variants\[0\]\.bwd: missing"):
        torch_opaque.load(tmp_path / "no_bwd.pt2")
