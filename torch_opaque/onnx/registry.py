"""One torchlib registry per opset while torch_opaque.onnx.export runs
(Note [Registry reuse])."""

from __future__ import annotations

import contextlib
import copy
import threading

# Note [Registry reuse]: every torch.onnx.export call rebuilds the torchlib
# registry (~4 s: onnxscript re-parses ~500 functions), and one export here makes
# 1 + (number of function bodies) of them. While export() runs, from_torchlib
# hands out copies of one build per opset instead. Should the exporter's
# internals change, the original from_torchlib is used.
_REGISTRIES: dict = {}
_REGISTRY_LOCK = threading.Lock()
_REGISTRY_USERS = [0]


@contextlib.contextmanager
def reuse_torchlib_registry():
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
        default_opset = _registration.call_constants.TORCHLIB_OPSET
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(klass, opset_version=default_opset):
        base = _REGISTRIES.get(opset_version)
        if base is None:
            base = original.__func__(klass, opset_version)
            if not isinstance(getattr(base, "functions", None), dict):
                return base
            _REGISTRIES[opset_version] = base
        registry = copy.copy(base)  # translations get registered into the copy
        registry.functions = {k: list(v) for k, v in base.functions.items()}
        return registry

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
