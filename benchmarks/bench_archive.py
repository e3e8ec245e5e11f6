"""Loading and inspecting archives: time and peak memory per file, each in a
fresh interpreter (run from the repository root:
``PYTHONPATH=.:tests python benchmarks/bench_archive.py``).

Rows: a torch_opaque archive (ops imported with allow=), the same archive
self-contained (ops re-created from stored programs), and 1 GiB zip bombs in
the manifest and the graph JSON (refused from the zip headers). The
``torch.export.load`` column loads the same file with the ops registered first.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch

import torch_opaque
import archive_corpus as C
from opaque_fixtures import archops

CHILD = r"""
import json, resource, sys, time
what, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
import torch, torch_opaque
t1 = time.perf_counter()
try:
    if what == "load":
        torch_opaque.load(path, allow=["opaque_fixtures"])
    elif what == "inspect":
        from torch_opaque.cli.inspect import inspect_file
        inspect_file(path)
    else:
        from opaque_fixtures import archops
        archops.Net()(archops.example_input(3))  # defines the ops torch.export.load needs
        torch.export.load(path)
    status = "ok"
except Exception as e:
    status = type(e).__name__
t2 = time.perf_counter()
print(json.dumps({"s": t2 - t1, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "status": status}))
"""


def run(what, path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path[:1] + ["tests", "."]))
    out = subprocess.run([sys.executable, "-c", CHILD, what, str(path)], capture_output=True, text=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return f"{r['s'] * 1000:7.0f} ms {r['peak']:6.0f} MiB {r['status']}"


def main():
    d = tempfile.mkdtemp()
    ep = archops.export_net()
    files = {"net.pt2": f"{d}/net.pt2", "net_sc.pt2": f"{d}/net_sc.pt2"}
    torch_opaque.save(ep, files["net.pt2"])
    torch_opaque.save(ep, files["net_sc.pt2"], self_contained=True)
    for label, suffix in (("bomb: manifest", "/extra/torch_opaque.json"), ("bomb: model.json", "/models/model.json")):
        p = f"{d}/{label.split()[1]}.pt2"
        C.write_zip(p, [C.bomb(e.name) if e.name.endswith(suffix) else e for e in C.read_entries(files["net.pt2"])])
        files[label] = p
    print(f"{'file':18} {'size':>9}  {'torch_opaque.load':28} {'inspect':28} {'torch.export.load':28}")
    for label, p in files.items():
        size = os.path.getsize(p)
        row = [run("load", p), run("inspect", p), run("torch", p)]
        print(f"{label:18} {size:9d}  " + " ".join(f"{c:28}" for c in row))
    print(f"(peak = the whole process's maximum RSS, torch import included; torch {torch.__version__})")


if __name__ == "__main__":
    main()
