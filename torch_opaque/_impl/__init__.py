"""The adapter layer: how an autograd.Function becomes a dispatcher operator.

- ``function``: the registry of wrapped classes and their overloads (``wrap``, ``op``).
- ``schema``: schema inference from type hints or from the values of a first call.
- ``context``: the ``ctx`` objects the forward/backward see, and the state codec.
- ``kernels``: the runners the C++ bridge calls (forward, backward, fake).

Nothing here is public API; ``torch_opaque/__init__.py`` re-exports what is.
"""
