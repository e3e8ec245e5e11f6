"""torch_opaque: any torch.autograd.Function as one opaque, differentiable operator.

    @torch_opaque.op                 # or torch_opaque.wrap(TheirFunction)
    class Foo(torch.autograd.Function): ...

    Foo.apply(x)                     # runs torch.ops.opaque.<Foo name>
    torch.export.export(model, (x,)) # the graph keeps one node per call

    with torch_opaque.auto(): ...    # every autograd.Function met becomes an op
    torch_opaque.export(model, (x,)) # torch.export.export inside auto()
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401
from .hooks.auto import AutoReport, auto, export
from .function import DEFAULT_NAMESPACE, OpaqueFunction, is_wrapped, lookup, op, wrap
from .errors import FakeForwardError, SchemaError, UnsupportedError
from .archive import ArchiveError, OpNotAllowedError, load, save
from . import passes

# Importing changes nothing in torch: the first wrap()/op/auto() reroutes
# Function.apply and arms the Dynamo hook (torch_opaque/hooks/__init__.py).


def load_library(path) -> None:
    """Load a shared library whose ops were written with torch_opaque/op.h
    (``torch.ops.load_library`` after the torch_opaque core is loaded, so both
    share one copy of it)."""
    torch.ops.load_library(str(path))

__version__ = "0.1.0"

__all__ = [
    "op",
    "wrap",
    "load_library",
    "lookup",
    "is_wrapped",
    "auto",
    "AutoReport",
    "export",
    "OpaqueFunction",
    "SchemaError",
    "FakeForwardError",
    "UnsupportedError",
    "DEFAULT_NAMESPACE",
    "save",
    "load",
    "ArchiveError",
    "OpNotAllowedError",
    "passes",
]
