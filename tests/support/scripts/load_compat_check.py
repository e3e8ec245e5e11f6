"""Loads a kept archive (tests/fixtures/v2_*), checks it against its
references, saves it again, loads that, checks again, and reports.

argv: archive, references (tests/fixtures/make_archives_v2.py), load options
(JSON), "plain" or "self_contained" (how to save it again; in the cwd).

References of kind "inference": per case the outputs, and the gradients of the
sum of the squares of all outputs with respect to the input ("input.0") and
the parameters ("param.<name>"). Kind "training": the program's outputs (the
loss, then the gradients named by ``names``). Needs only torch and
torch_opaque (scripts/check_archive_compat.sh runs it under another torch).
"""

import importlib.util, json, sys
import torch
import torch_opaque
from torch_opaque import passes
from torch_opaque.archive.manifest import VERSION

path, ref_path, options, resave = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
assert resave in ("plain", "self_contained"), resave
ref = torch.load(ref_path)


def as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check(ep, label):
    if ref["kind"] == "training":
        assert torch_opaque.training_outputs(ep) == ref["names"], torch_opaque.training_outputs(ep)
    for i, case in enumerate(ref["cases"]):
        where = f"{label}, case {i} (batch {case['args'][0].shape[0]})"
        mod = ep.module()
        if ref["kind"] == "training":
            got = as_list(mod(*case["args"]))
        else:
            args = [a.clone().requires_grad_() for a in case["args"]]
            got = as_list(mod(*args))
            sum(o.square().sum() for o in got).backward()
            grads = {f"input.{j}": a.grad for j, a in enumerate(args)}
            grads.update({f"param.{n}": p.grad for n, p in mod.named_parameters()})
            assert sorted(grads) == sorted(case["grads"]), (where, sorted(grads))
            for name, want in case["grads"].items():
                torch.testing.assert_close(grads[name], want, msg=lambda m: f"{where}, grad {name}: {m}")
            for p in mod.parameters():  # the module shares its parameters with ep
                p.grad = None
        assert len(got) == len(case["outputs"]), (where, len(got))
        for j, (g, w) in enumerate(zip(got, case["outputs"])):
            torch.testing.assert_close(g.detach(), w, msg=lambda m: f"{where}, output {j}: {m}")


def overloads(ep):
    """The overloads of the program's own ops (stored: "<overload>_stored_<digest>")."""
    return sorted({n.target._overloadname for n in ep.graph.nodes
                   if isinstance(n.target, torch._ops.OpOverload)
                   and n.target.namespace not in ("aten", "prims")})


ep = torch_opaque.load(path, **options)
check(ep, "loaded")
torch_opaque.save(ep, "again.pt2", self_contained=resave == "self_contained")
again = torch_opaque.load("again.pt2", **options)
check(again, "saved again and loaded")

print(json.dumps({
    "torch": torch.__version__,
    "torch_opaque": torch_opaque.__file__,
    "format_version": VERSION,
    "cases": len(ref["cases"]),
    "imported": sorted(m for m in sys.modules if m.startswith("opaque_fixtures")),
    "findable": importlib.util.find_spec("opaque_fixtures") is not None,
    "ops": [r.qualified_name for r in passes.list_opaque_ops(ep)],
    "overloads": overloads(ep),
    "overloads_again": overloads(again),
}))
