"""Loads each archive and reports its error (or None) and the fixture modules imported.

argv: load options (JSON), archives..."""

import json, sys
import torch_opaque
options = json.loads(sys.argv[1])
results = {}
for path in sys.argv[2:]:
    try:
        torch_opaque.load(path, **options)
        results[path] = None
    except Exception as e:
        results[path] = [type(e).__name__, str(e)]
print(json.dumps({"results": results,
                  "imported": [m for m in sys.modules if m.startswith("opaque_fixtures")]}))
