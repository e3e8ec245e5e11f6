"""``torch.onnx.export(..., dynamo=True)`` translates opaque ops with no extra
argument: every registry its exporter builds also holds torch_opaque's
translations (Note [torch.onnx.export of opaque ops] in
torch_opaque/onnx/torch_onnx_export.py).

Installed right after torch.onnx first imports its registry module (which
imports onnxscript), never by ``import torch_opaque``: armed by the first op a
process defines (the ``routing_installed`` and ``library_loaded`` extension
points, Note [Extension points]), as the Dynamo hook is.
"""

from __future__ import annotations

import sys
import warnings
import weakref

from .._impl.extension_points import AfterFirstImport

REGISTRY_MODULE = "torch.onnx._internal.exporter._registration"


def install(module) -> None:
    """Wrap ``ONNXRegistry.from_torchlib`` of torch.onnx's registry module, once."""
    cls = getattr(module, "ONNXRegistry", None)
    original = getattr(cls, "__dict__", {}).get("from_torchlib")
    if not isinstance(original, classmethod) or not hasattr(cls, "register_op"):
        warnings.warn(
            "torch_opaque: this torch's ONNX exporter has no ONNXRegistry.from_torchlib / "
            "register_op; torch.onnx.export does not translate opaque ops. Use "
            "torch_opaque.onnx.export instead, or report this torch version."
        )
        return
    if getattr(original.__func__, "_torch_opaque", False):
        return

    def from_torchlib(klass, *args, **kwargs):
        registry = original.__func__(klass, *args, **kwargs)
        finish(registry)
        return registry

    from_torchlib._torch_opaque = True
    from_torchlib._torch_opaque_original = original.__func__
    from_torchlib._torch_opaque_finish = finish  # (onnx/registry.py's copies get it too)
    from_torchlib.__doc__ = original.__func__.__doc__
    cls.from_torchlib = classmethod(from_torchlib)


# The registries made for exports still running: an op a Function defines at
# its first call, while torch.export captures the model inside torch.onnx.export,
# joins them (the registry was built before the capture).
LIVE_REGISTRIES: "weakref.WeakSet" = weakref.WeakSet()


def finish(registry) -> None:
    """A registry torch.onnx just built: a translation of every opaque op, and
    of those defined while it is in use."""
    from ..onnx.torch_onnx_export import add_translations

    add_translations(registry)
    LIVE_REGISTRIES.add(registry)


def add_overload(overload) -> None:
    """A Python Function's new overload: its ops join the live registries."""
    new_ops((overload.op, overload.fwd_op, overload.bwd_op))


def new_ops(targets) -> None:
    """Ops just defined (Python Functions, C++ libraries) join the live registries."""
    if not LIVE_REGISTRIES:
        return
    from ..onnx.torch_onnx_export import register_translations

    for registry in list(LIVE_REGISTRIES):
        register_translations(registry, targets)


_WATCHER = AfterFirstImport(REGISTRY_MODULE, install)


def install_when_onnx_loads() -> None:
    """Install now if torch.onnx's registry module is loaded, else when it is."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and hasattr(module, "ONNXRegistry"):
        install(module)
    else:
        _WATCHER.arm()
