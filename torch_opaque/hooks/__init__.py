"""Every patch torch_opaque makes to PyTorch's internals, in one place.

- :mod:`.apply`: reroutes the code of ``torch.autograd.Function.apply`` so
  that every way of reaching it (``Cls.apply``, and aliases such as
  ``f = Cls.apply`` bound at any time) can run a wrapped class's op
  (Note [Apply interception]).
- :mod:`.auto`: ``torch_opaque.auto()``, per thread, with its fall-back to the
  ordinary Function (Note [Auto fall-back]).
- :mod:`.dynamo`: Dynamo's handling of ``Cls.apply`` calls, installed when
  ``torch._dynamo`` is first imported, never by ``import torch_opaque``
  (Note [Dynamo and wrapped classes]).
- :mod:`.compiled_double_backward`: AOTAutograd's compiled Function of a
  region whose graph calls opaque ops replays that graph eagerly under
  ``create_graph=True``, installed with the Dynamo hook
  (Note [Double backward in compiled graphs]).
- :mod:`.fx`: ``torch.fx.symbolic_trace`` records a wrapped class's call as one
  node of its op; no patch, asked by the apply path when an argument is a
  Proxy (Note [FX symbolic tracing]).
- :mod:`.onnx_registry`: every registry ``torch.onnx.export(dynamo=True)``
  builds also translates opaque ops, installed when torch.onnx first imports
  its registry module (Note [torch.onnx.export of opaque ops]).
- :mod:`.torchscript`: ``torch.jit.script`` resolves ``Cls.apply`` of a wrapped
  class to its op, installed with the apply route
  (Note [TorchScript and wrapped classes]).

Each patch first checks that the internals it replaces look as expected for
this torch version and, if not, leaves them alone with a warning that names
what is missing.
"""

from .apply import ORIGINAL_APPLY, install_apply_route  # noqa: F401
from .dynamo import install_when_dynamo_loads  # noqa: F401
