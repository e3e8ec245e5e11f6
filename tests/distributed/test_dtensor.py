"""Opaque ops on DTensor and under tensor parallel, against the stock Functions
(Note [Sharding opaque ops] in torch_opaque/integrations/sharding.py).

One run of two processes (gloo on 127.0.0.1, dtensor_worker.py) makes every
check; each test reads its result. Bounded: the ranks time out their
collectives, and the run is killed past TIMEOUT seconds.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.build_tree import EXAMPLE_OPS_LIB, missing
from support.processes import child_env

WORKER = Path(__file__).resolve().parent / "dtensor_worker.py"
WORLD = 2
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("torch.distributed.tensor")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch without gloo")
    assert EXAMPLE_OPS_LIB.exists(), missing(EXAMPLE_OPS_LIB)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD), str(port), str(EXAMPLE_OPS_LIB)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    per_rank = []
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out + err
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    return per_rank


def _check(results, name):
    for rank, r in enumerate(results):
        assert r[name] == "ok", f"rank {rank}:\n{r[name]}"


@pytest.mark.parametrize(
    "name",
    [
        "pointwise_wrap",
        "linear_rule",
        "colwise_parallel",
        "missing_rule",
        "auto_without_rule",
        "auto_with_rule",
        "two_outputs",
        "compiled",
        "cpp_op",
    ],
)
def test_dtensor(results, name):
    _check(results, "check_" + name)
