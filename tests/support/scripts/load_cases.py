"""Loads each archive of a list (and runs the program when asked), reporting
each error or result; a crash fails the test that started this process.

argv: cases (JSON list of {"path", "options", "run"}); "options" may hold
"limits" (ArchiveLimits fields). "run": the program is called on
torch.ones(<run>) and the sum of its output reported. "import_first": a
module this process imports before loading (a Function it owns)."""

import importlib, json, sys, warnings
import torch, torch_opaque
from torch_opaque.archive import ArchiveLimits

out = []
for case in json.loads(sys.argv[1]):
    options = dict(case.get("options", {}))
    if "limits" in options:
        options["limits"] = ArchiveLimits(**options["limits"])
    report = {"error": None, "value": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case.get("import_first"):
            importlib.import_module(case["import_first"])
        try:
            ep = torch_opaque.load(case["path"], **options)
            if case.get("run"):
                report["value"] = float(ep.module()(torch.ones(case["run"])).sum())
        except Exception as e:
            report["error"] = [type(e).__name__, str(e)]
    report["warnings"] = [str(w.message) for w in caught if "torch_opaque" in str(w.message)]
    out.append(report)
print(json.dumps(out))
