"""The pip settings a virtual environment for torch REQUIREMENT gets (scripts/dev.sh).

    python scripts/pip_settings.py PIP REQUIREMENT     e.g. .venv-torch-2.15/bin/pip torch==2.15.0

Note [A pip configuration that caps torch]: a machine's pip configuration can
hold constraints (`constraint = FILE` in a pip.conf, or PIP_CONSTRAINT) that
cap torch below a release scripts/dev.sh tests, for instance where only some
releases are kept on a local index. Every pip command in that release's
environment would then fail, or move torch back to the cap (`pip install -e .`
resolves torch again). pip cannot drop one setting of its configuration files,
only all of them (PIP_CONFIG_FILE=/dev/null), so for such a release we drop
them all and give back, as PIP_* variables, every other setting they held
(cert, index URLs, find-links, ...), and the constraint files less their torch
lines. Where nothing caps the release (CI machines, most others), nothing
changes.

Prints one line per environment variable to set, `NAME=VALUE` (none when
nothing caps the release), and on stderr what it dropped.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


def configured(pip: str) -> dict[str, str]:
    """`pip config list`: {"global.cert": "...", ...} from the configuration files."""
    out = subprocess.run([pip, "config", "list"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PIP_CONFIG_FILE"})
    settings = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith(":env:"):
            settings[key] = value.strip().strip("'\"")
    return settings


def caps(path: str, wanted: str) -> bool:
    """Whether the constraint file excludes torch `wanted`."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return False
    for line in lines:
        line = line.split("#", 1)[0].strip()
        try:
            r = Requirement(line) if line else None
        except InvalidRequirement:
            continue
        if r is not None and r.name == "torch" and not r.specifier.contains(wanted, prereleases=True):
            return True
    return False


def without_torch(paths: list[str], venv: str) -> str:
    """A constraint file in `venv` holding the lines of `paths` other than torch's."""
    kept = []
    for path in paths:
        for line in open(path).read().splitlines():
            body = line.split("#", 1)[0].strip()
            try:
                if body and Requirement(body).name == "torch":
                    continue
            except InvalidRequirement:
                pass
            kept.append(line)
    name = os.path.join(venv, "constraints-less-torch.txt")
    with open(name, "w") as f:
        f.write("\n".join(kept) + "\n")
    return name


def main(pip: str, requirement: str) -> None:
    wanted = str(next(iter(Requirement(requirement).specifier)).version)
    venv = os.path.dirname(os.path.dirname(os.path.abspath(pip)))
    settings = configured(pip)
    files = [p for k, v in settings.items() if k.endswith(".constraint") for p in v.split()]
    env_files = os.environ.get("PIP_CONSTRAINT", "").split()
    if not any(caps(p, wanted) for p in files + env_files):
        return
    capped = [p for p in files + env_files if caps(p, wanted)]
    print(f"== the pip configuration caps torch below {wanted} ({', '.join(capped)}): "
          f"{os.path.basename(venv)} uses it less its torch constraint "
          f"(Note [A pip configuration that caps torch])", file=sys.stderr)
    out = {"PIP_CONFIG_FILE": os.devnull}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        if section in ("global", "install") and name != "constraint":
            out.setdefault("PIP_" + name.upper().replace("-", "_"), value)
    rest = [p for p in files + env_files if os.path.exists(p)]
    out["PIP_CONSTRAINT"] = without_torch(rest, venv) if rest else ""
    for name, value in out.items():
        if name not in os.environ or name in ("PIP_CONSTRAINT", "PIP_CONFIG_FILE"):
            print(f"{name}={value}")


if __name__ == "__main__":
    main(*sys.argv[1:])
