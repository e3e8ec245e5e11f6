"""One torchlib registry per opset while torch_opaque.onnx.export runs
(Note [Registry reuse])."""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings

# Note [Registry reuse]: every torch.onnx.export call rebuilds the torchlib
# registry (~4 s: onnxscript re-parses ~500 functions), and one export here makes
# 1 + (number of function bodies) of them. While export() runs, from_torchlib
# hands out copies of one build per opset instead. Should the exporter's
# internals change, the original from_torchlib is used.
_REGISTRIES: dict = {}
_REGISTRY_LOCK = threading.Lock()
_REGISTRY_USERS = [0]
BUILDS = [0]  # torchlib registries built by the cache (tests count them)


@contextlib.contextmanager
def reuse_torchlib_registry():
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
        default_opset = _registration._constants.TORCHLIB_OPSET
    except (ImportError, AttributeError, KeyError):
        warnings.warn(
            "torch_opaque.onnx: this torch's ONNX exporter has no ONNXRegistry.from_torchlib; "
            "every function body is exported with a registry built afresh (slower)."
        )
        yield
        return
    if getattr(original.__func__, "_torch_opaque_reuse", False):
        yield  # an export inside one that reuses already
        return
    # torch's own entries only: the cached base must not hold opaque ops
    # (Note [Ops that graphs hold]); each copy gets them (integrations/onnx_registry.py)
    build = getattr(original.__func__, "_torch_opaque_original", original.__func__)
    finish = getattr(original.__func__, "_torch_opaque_finish", None)

    def from_torchlib(klass, opset_version=default_opset):
        base = _REGISTRIES.get(opset_version)
        if base is None:
            base = build(klass, opset_version)
            BUILDS[0] += 1
            if not isinstance(getattr(base, "functions", None), dict):
                return base
            _REGISTRIES[opset_version] = base
        registry = copy.copy(base)  # translations get registered into the copy
        registry.functions = {k: list(v) for k, v in base.functions.items()}
        if finish is not None:
            finish(registry)
        return registry

    from_torchlib._torch_opaque_reuse = True
    with _REGISTRY_LOCK:
        _REGISTRY_USERS[0] += 1
        cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        with _REGISTRY_LOCK:
            _REGISTRY_USERS[0] -= 1
            if not _REGISTRY_USERS[0]:
                cls.from_torchlib = original
