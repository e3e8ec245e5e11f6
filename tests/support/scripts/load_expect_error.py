"""Loads an archive and reports the error (or None) and the fixture modules imported.

argv: archive, load options (JSON)."""

import json, sys
import torch_opaque

path, options = sys.argv[1], json.loads(sys.argv[2])
try:
    torch_opaque.load(path, **options)
except Exception as e:
    err = {"type": type(e).__name__, "message": str(e),
           "is_archive_error": isinstance(e, torch_opaque.ArchiveError)}
else:
    err = None
print(json.dumps({
    "error": err,
    "imported": sorted(m for m in sys.modules
                       if m.startswith("opaque_fixtures") or m.startswith("evil_")),
}))
