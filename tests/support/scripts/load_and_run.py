"""Loads an archive, runs it on the reference input, reports the fixture modules imported.

argv: archive, load options (JSON), reference results."""

import json, sys
import torch, torch_opaque
ep = torch_opaque.load(sys.argv[1], **json.loads(sys.argv[2]))
ref = torch.load(sys.argv[3])
torch.testing.assert_close(ep.module()(ref["x"]), ref["y"])
print(json.dumps({"imported": sorted(m for m in sys.modules if m.startswith("opaque_fixtures"))}))
