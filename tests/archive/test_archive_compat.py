"""Archives written by earlier torch_opaque versions keep loading.

tests/fixtures/v1_net*.pt2 were written (tests/fixtures/make_archives.py) by the
code of format version 1, before the manifest became typed records: they are
loaded, run, differentiated, re-exported and trained in fresh processes.
"""

import json
import os

from support.processes import FIXTURES_DIR, last_json, run_script

FIXTURES = str(FIXTURES_DIR)


def test_v1_archive_loads_with_the_allowed_module(tmp_path):
    proc = run_script(
        "load_run_train.py",
        [os.path.join(FIXTURES, "v1_net.pt2"), os.path.join(FIXTURES, "v1_net_ref.pt"),
         json.dumps({"allow": ["opaque_fixtures"]})],
        tmp_path,
        with_fixtures=True,
    )
    out = last_json(proc)
    assert out["imported"] == ["opaque_fixtures", "opaque_fixtures.archops"]
    assert out["ops"] == ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]


def test_v1_self_contained_archive_loads_without_the_module(tmp_path):
    proc = run_script(
        "load_run_train.py",
        [os.path.join(FIXTURES, "v1_net_sc.pt2"), os.path.join(FIXTURES, "v1_net_ref.pt"), "{}"],
        tmp_path,
        with_fixtures=False,
    )
    out = last_json(proc)
    assert out["imported"] == [] and out["findable"] is False
    assert out["ops"] == ["opaque::ArchCube", "opaque::ArchMulAdd", "opaque::ArchScaledSin"]
