"""Loads an archive twice; reports each outcome.

argv: archive."""

import json, sys
import torch_opaque
out = []
for _ in range(2):
    try:
        torch_opaque.load(sys.argv[1])
        out.append("loaded")
    except torch_opaque.ArchiveError as e:
        out.append(str(e))
print(json.dumps(out))
