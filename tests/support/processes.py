"""Fresh Python interpreters for tests that need a process of their own (ops
not registered yet, modules not imported, a package that fails to load).

One helper for all of them: the child gets the repository root on its path
(torch_opaque), the tests directory (opaque_fixtures) only when asked, and
either inline code or a script from tests/support/scripts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional, Sequence

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = TESTS_DIR.parent
SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
FIXTURES_DIR = TESTS_DIR / "fixtures"  # archives written by earlier versions


def child_env(with_fixtures: bool = False, extra_path: Sequence = ()) -> dict:
    """This process's environment with PYTHONPATH set for a child."""
    paths = [str(REPO_DIR)] + ([str(TESTS_DIR)] if with_fixtures else []) + [str(p) for p in extra_path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_python(
    code: Optional[str] = None,
    *,
    script: Optional[str] = None,
    module: Optional[str] = None,
    args: Sequence = (),
    cwd=None,
    with_fixtures: bool = False,
    extra_path: Sequence = (),
    env: Optional[dict] = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Runs inline `code` (dedented), `script` (a file name in
    tests/support/scripts) or `module` (python -m) in a fresh interpreter with
    `args`; stdout and stderr captured as text. `env` replaces the environment
    built from `with_fixtures` / `extra_path`."""
    if sum(x is not None for x in (code, script, module)) != 1:
        raise ValueError("run_python: give exactly one of code, script, module")
    if code is not None:
        cmd = ["-c", textwrap.dedent(code)]
    elif script is not None:
        cmd = [str(SCRIPTS_DIR / script)]
    else:
        cmd = ["-m", module]
    return subprocess.run(
        [sys.executable, *cmd, *map(str, args)],
        cwd=None if cwd is None else str(cwd),
        env=child_env(with_fixtures, extra_path) if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The last JSON object the child printed, after checking it succeeded."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


def run_script(script: str, args: Sequence, cwd, with_fixtures: bool, extra_path: Sequence = ()):
    """run_python of a script in tests/support/scripts."""
    return run_python(
        script=script, args=args, cwd=cwd, with_fixtures=with_fixtures, extra_path=extra_path
    )
