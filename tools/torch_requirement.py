"""Build-time metadata: a wheel requires the torch release it was compiled against.

A scikit-build-core dynamic-metadata provider (pyproject.toml,
``[[tool.dynamic-metadata]]``). torch_opaque's C++ core and ``torch_opaque._C``
link libtorch and use its C++ API, which changes between torch releases, so a
wheel runs only with the torch release (major.minor) that was importable in its
build environment: building against torch 2.13.0 adds ``torch==2.13.*`` to the
wheel's requirements, next to the supported range written in ``[project]``.
An sdist is not compiled yet and keeps only the range.

    >>> Provider().dynamic_metadata({}, {})          # doctest: +SKIP
    {'dependencies': ['torch==2.13.*']}
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, Mapping


def torch_requirement() -> str:
    """``torch==X.Y.*`` for the torch installed in this (build) environment."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "torch_opaque: building a wheel needs torch in the build environment. "
            "Install torch first and build with `pip install --no-build-isolation .`, "
            "or let pip make an isolated build environment (pyproject.toml's "
            "build-system requirements name the torch release)."
        ) from None
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"torch_opaque: cannot read torch's version {version!r}")
    return f"torch=={match.group(1)}.{match.group(2)}.*"


class Provider:
    """Adds ``torch==X.Y.*`` to ``dependencies`` (not for an sdist)."""

    def __init__(self) -> None:
        self._state = "wheel"

    def build_state(self, state: str) -> None:
        self._state = state

    def dynamic_wheel(self, settings: Mapping[str, Any]) -> dict[str, bool]:
        # The sdist's PKG-INFO marks Requires-Dist as changing in the wheel.
        return {"dependencies": True}

    def dynamic_metadata(
        self, settings: Mapping[str, Any], project: Mapping[str, Any]
    ) -> dict[str, Any]:
        if settings:
            raise RuntimeError(f"torch_opaque: tools/torch_requirement.py takes no settings, got {dict(settings)}")
        if self._state == "sdist":
            return {"dependencies": []}
        return {"dependencies": [torch_requirement()]}
