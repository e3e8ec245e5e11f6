"""torch_opaque: any torch.autograd.Function as one opaque, differentiable operator.

    @torch_opaque.op                 # or torch_opaque.wrap(TheirFunction)
    class Foo(torch.autograd.Function): ...

    Foo.apply(x)                     # runs torch.ops.opaque.<Foo name>
    torch.export.export(model, (x,)) # the graph keeps one node per call

    with torch_opaque.auto(): ...    # every autograd.Function met becomes an op
    torch_opaque.export(model, (x,)) # torch.export.export inside auto()
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from ._native import _C
from ._impl.auto_mode import AutoReport, auto, export
from ._impl.function import DEFAULT_NAMESPACE, is_wrapped, lookup, op, wrap
from ._impl.opaque_function import OpaqueFunction
from ._impl import extension_points as _extension_points
from . import integrations as _integrations  # noqa: F401  (attaches them: Note [Extension points])
from .errors import FakeForwardError, RegistrationError, SchemaError, UnsupportedError
from .archive import ArchiveError, OpNotAllowedError, load, save
from . import config, passes
from ._impl import cpp_fakes as _cpp_fakes
from .training import export_training, training_outputs
from .integrations.sharding import register_sharding  # Note [Sharding opaque ops]

# Importing changes nothing in torch on 2.13: the first wrap()/op/auto() reroutes
# Function.apply and arms the Dynamo hook (torch_opaque/integrations/__init__.py). From
# 2.14, where Function.apply is C code, importing reroutes it (Note [Aliases
# bound before routing, where apply is C] in torch_opaque/_compat.py).
from . import _compat

_compat.route_apply_on_import()


def load_library(path) -> None:
    """Load a shared library whose ops were written with torch_opaque/op.h
    (``torch.ops.load_library`` after the torch_opaque core is loaded, so both
    share one copy of it).

    Raises :class:`RegistrationError` listing each op of the library that could
    not be registered (a name already taken, an unqualified name, argument names
    that do not match): the ops that did register stay usable.
    """
    _C.take_registration_errors()  # failures of libraries loaded other ways are not ours
    # Dynamo routes torch.ops calls of C++ ops itself; its hook is armed for
    # double backward through compiled graphs holding them, and torch.onnx's
    # for their translations (Note [Extension points]).
    _extension_points.fire(_extension_points.library_loaded)
    before = _cpp_fakes.op_names()
    torch.ops.load_library(str(path))
    errors = _C.take_registration_errors()
    # Note [C++ kernels as fakes]: symbolic sizes inside the kernels on fake tensors
    _cpp_fakes.register_kernel_fakes(_cpp_fakes.op_names() - before)
    if errors:
        lines = "\n".join(f"  - {e}" for e in errors)
        raise RegistrationError(
            f"torch_opaque: loading {path} failed to register {len(errors)} op(s):\n{lines}\n"
            f"Fix the TORCH_OPAQUE_DEF lines named above and rebuild the library."
        )

def set_debug(on: bool = True) -> None:
    """Debug mode (also ``TORCH_OPAQUE_DEBUG=1`` in the environment): each eager
    call of a C++ op that has a ``fake`` also runs the fake on meta copies of its
    inputs and raises if output shapes or dtypes differ (Note [Debug mode] in
    include/torch_opaque/fake_checks.h). Costs a fake call per op call."""
    _C.set_debug(bool(on))


def debug_enabled() -> bool:
    """Whether debug mode (:func:`set_debug`) is on."""
    return _C.debug_enabled()


__version__ = "0.1.0"  # the one place the version is written (Note [One version], CMakeLists.txt)

# For find_package(torch_opaque) in CMake, like torch.utils.cmake_prefix_path:
# the installed package is a CMake prefix (lib/cmake/torch_opaque, include/,
# lib/libtorch_opaque.so next to _C; Note [Wheel layout] in CMakeLists.txt).
import os as _os

cmake_prefix_path = _os.path.dirname(_os.path.abspath(_C.__file__))

__all__ = [
    "op",
    "wrap",
    "load_library",
    "set_debug",
    "debug_enabled",
    "lookup",
    "is_wrapped",
    "auto",
    "AutoReport",
    "export",
    "OpaqueFunction",
    "SchemaError",
    "FakeForwardError",
    "UnsupportedError",
    "RegistrationError",
    "DEFAULT_NAMESPACE",
    "save",
    "load",
    "ArchiveError",
    "OpNotAllowedError",
    "passes",
    "export_training",
    "training_outputs",
    "register_sharding",
]
