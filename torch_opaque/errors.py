"""Exceptions raised by torch_opaque; each message names the problem and the fix.

Every class derives from :class:`TorchOpaqueError`, so ``except
torch_opaque.errors.TorchOpaqueError`` catches anything torch_opaque raises on
purpose; each also keeps the builtin base that callers caught before.
"""


class TorchOpaqueError(Exception):
    """Base of every error torch_opaque raises on purpose."""


class SchemaError(TorchOpaqueError, TypeError):
    """An argument, annotation or output that an operator schema cannot carry."""


class FakeForwardError(TorchOpaqueError, RuntimeError):
    """The forward cannot run on fake tensors while tracing and no ``fake`` was given."""


class UnsupportedError(TorchOpaqueError, RuntimeError, TypeError):
    """The Function uses a feature an opaque op cannot carry (mark_dirty, ctx state...)."""


class RegistrationError(TorchOpaqueError, RuntimeError):
    """Ops of a C++ library (TORCH_OPAQUE_DEF) that failed to register while it loaded."""


class ArchiveError(TorchOpaqueError, RuntimeError):
    """An archive cannot be written or read (corrupted, truncated, over a size
    limit, invalid manifest, a part that would need unpickling, ops that cannot
    be restored)."""


class OpNotAllowedError(ArchiveError):
    """The archive needs ops whose defining modules ``load`` may not import."""


class OnnxExportError(TorchOpaqueError, RuntimeError):
    """An opaque op that cannot be exported to ONNX as asked
    (``torch_opaque.onnx.export``); the message says what to pass."""
