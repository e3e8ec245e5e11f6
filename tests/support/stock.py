"""Wrapped Functions run as stock autograd.Function: the reference that
tests compare torch_opaque's paths with."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch_opaque._impl.apply_route import ORIGINAL_APPLY


@contextlib.contextmanager
def stock_functions(functions: Iterable[type]) -> Iterator[None]:
    """The Functions run as stock autograd.Function (no opaque op) inside."""
    functions = tuple(functions)
    saved = {cls: cls.__dict__["apply"] for cls in functions}
    try:
        for cls in functions:
            cls.apply = classmethod(ORIGINAL_APPLY)
        yield
    finally:
        for cls, apply in saved.items():
            cls.apply = apply
