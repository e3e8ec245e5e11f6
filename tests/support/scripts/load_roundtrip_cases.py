"""Loads each self-contained archive of the round-trip corpus in this fresh
process, which cannot import the module that defined its Functions, runs one
training step of it and compares it with the eager step of the saving process
(tests/archive/test_archive_roundtrip.py).

argv (as tests/archive_corpus.py's run_cases passes them): a marker file
(unused), the cases (JSON: name, archive path, options: {"ref": the eager
step, torch.save'd; "module": the defining module}), the CPU seconds a case
may take (RLIMIT_CPU), an address-space headroom (unused).

Prints ``START <name>`` before each case and ``CASE <json>`` after it, the
result ``{"load": ..., "run": ...}`` each ``[error type or "ok", message]``."""

import importlib.util
import json
import resource
import sys

import torch

import torch_opaque
from roundtrip_loss import compare, step

cases, case_cpu = json.load(open(sys.argv[2])), float(sys.argv[3])

for c in cases:
    print("START " + json.dumps(c["name"]), flush=True)
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + case_cpu) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
    r = {}
    module = c["options"]["module"]
    ep = None
    try:
        assert importlib.util.find_spec(module) is None, f"this process can import {module}"
        ep = torch_opaque.load(c["path"])
        r["load"] = ["ok", ""]
    except Exception as e:
        r["load"] = [type(e).__name__, str(e)[:3000]]
    if ep is not None:
        ref = torch.load(c["options"]["ref"])
        try:
            got = step(ep.module(), ref["args"], ref["grad"], ref["seed"], ref["want"]["diff"])
            compare(got, ref["want"], ref["atol"])
            assert module not in sys.modules, f"{module} was imported"
            r["run"] = ["ok", ""]
        except Exception as e:
            r["run"] = [type(e).__name__, str(e)[:3000]]
    print("CASE " + json.dumps({"name": c["name"], "result": r}), flush=True)
