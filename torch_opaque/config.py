"""Process-wide settings of torch_opaque.

``inductor_inline`` (default True): Inductor compiles the forward and backward
bodies of Functions wrapped from Python, fusing them with the code around
them; False keeps each call an opaque call of the op in Inductor's graphs
(Note [Inductor sees through opaque ops] in integrations/inductor.py). Read
when a graph is compiled: call ``torch._dynamo.reset()`` after changing it to
recompile graphs compiled before. Export graphs (``torch.export``,
``export_training``, archives, ONNX) keep one opaque node per call either way.

Example::

    >>> import torch_opaque
    >>> torch_opaque.config.inductor_inline
    True
"""

inductor_inline: bool = True
