"""Loads and inspects each case of a crafted-archive corpus; reports per case the
error type and message, whether the planted payload's marker file exists, and
the peak memory.

argv: marker file, cases (JSON file: name, path, load options)."""

import json, os, resource, sys, time
marker, cases = sys.argv[1], json.load(open(sys.argv[2]))
import torch_opaque
from torch_opaque.cli.inspect import inspect_file
from torch_opaque.errors import TorchOpaqueError
out = {}
for c in cases:
    r = {}
    for what in ("load", "inspect"):
        t = time.time()
        try:
            if what == "load":
                torch_opaque.load(c["path"], **c["options"])
            else:
                inspect_file(c["path"])
            r[what] = ["ok", "", True]
        except Exception as e:
            r[what] = [type(e).__name__, str(e), isinstance(e, TorchOpaqueError)]
        r[what + "_s"] = time.time() - t
        r[what + "_marker"] = os.path.exists(marker)
    out[c["name"]] = r
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"results": out, "peak_mib": peak}))
