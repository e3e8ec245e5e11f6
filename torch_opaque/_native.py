"""The compiled core, ``torch_opaque._C`` (csrc/), loaded after libtorch, with an
error that says how to build it when it does not load. Every module that calls
into C++ imports it from here."""

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    _C = importlib.import_module("torch_opaque._C")
except ImportError as _e:  # a source checkout that was never built, or a torch mismatch
    raise ImportError(
        f"torch_opaque: its compiled core (torch_opaque._C) did not load: {_e}. "
        f"Build and install the package against the torch in this environment "
        f"(`pip install --no-build-isolation .`, or `scripts/dev.sh build` in a checkout), "
        f"with the torch version it was built for."
    ) from _e
