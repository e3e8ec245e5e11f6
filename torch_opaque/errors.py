"""Exceptions raised by torch_opaque; each message names the problem and the fix."""


class SchemaError(TypeError):
    """An argument, annotation or output that an operator schema cannot carry."""


class FakeForwardError(RuntimeError):
    """The forward cannot run on fake tensors while tracing and no ``fake`` was given."""


class UnsupportedError(RuntimeError, TypeError):
    """The Function uses a feature an opaque op cannot carry (mark_dirty, ctx state...)."""


class RegistrationError(RuntimeError):
    """Ops of a C++ library (TORCH_OPAQUE_DEF) that failed to register while it loaded."""
