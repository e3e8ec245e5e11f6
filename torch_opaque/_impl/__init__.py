"""The core: how an autograd.Function becomes a dispatcher operator, and how
its calls reach it. It imports nothing of ``torch_opaque/integrations/``,
which attach through ``extension_points`` (tests/test_layering.py).

- ``function``: ``wrap`` and ``op``; ``opaque_function``: a wrapped class's
  calls and overloads; ``overload``: one schema's ops, kernels and fakes;
  ``registry``: classes and op names, and the release of dead classes' ops.
- ``schema``: schema inference from type hints or from the values of a first call.
- ``context``: the ``ctx`` objects the forward/backward see, and the state codec.
- ``kernels``: the runners the C++ bridge calls (forward, backward, fake).
- ``apply_route`` and ``routing``: every ``Function.apply`` call reaches the
  op of a wrapped class; ``auto_mode`` / ``auto_state``: ``torch_opaque.auto()``.
- ``extension_points``: the events integrations attach to.

Nothing here is public API; ``torch_opaque/__init__.py`` re-exports what is.
"""
