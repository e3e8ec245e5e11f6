"""What torch_opaque's ops do in the rest of PyTorch: one file per consumer,
each attached to the core here, in one place (Note [Extension points] in
torch_opaque/_impl/extension_points.py).

- :mod:`.subclasses`: ops on wrapper subclasses such as NestedTensor
  (Note [Ops on wrapper subclasses]);
- :mod:`.sharding`: DTensor sharding rules (Note [Sharding opaque ops]);
- :mod:`.onnx_registry`: ``torch.onnx.export(dynamo=True)``'s registries
  translate opaque ops (Note [torch.onnx.export of opaque ops]);
- :mod:`.autocast`: the Autocast kernels that call each op's autocast variant
  (Note [Autocast in the call]);
- :mod:`.inductor`: Inductor inlines the Functions' bodies
  (Note [Inductor sees through opaque ops]);
- :mod:`.fx`: ``torch.fx.symbolic_trace`` records one node per call
  (Note [FX symbolic tracing]);
- :mod:`.dynamo` (with :mod:`.compiled_double_backward`): torch.compile and
  strict export emit the op (Note [Dynamo and wrapped classes]);
- :mod:`.torchscript`: ``torch.jit.script`` calls the op
  (Note [TorchScript and wrapped classes]).

Importing this changes nothing in torch: each patch waits for the first op
(``routing_installed``, ``library_loaded``) or for the torch module it
patches to be imported, and first checks that the internals it replaces look
as expected for this torch version (if not: a warning that names what is
missing, and no patch).
"""

from .._impl.extension_points import attach
from . import autocast, dynamo, fx, inductor, onnx_registry, sharding, subclasses, torchscript

# The order of a point's callbacks is the order they run in.
attach("overload_defined", subclasses.register)
attach("overload_defined", sharding.install_for_overload)
attach("overload_defined", onnx_registry.add_overload)
attach("overload_defined", autocast.register)
attach("overload_defined", inductor.add)
attach("overload_forgotten", sharding.forget)
attach("overload_forgotten", inductor.remove)
attach("held_references", inductor.table_references)
attach("before_call", sharding.refuse_without_rule)
attach("auto_runs_stock", sharding.auto_call_runs_stock)
attach("tracers", fx)
attach("routing_installed", dynamo.install_when_dynamo_loads)
attach("routing_installed", torchscript.install)
attach("routing_installed", onnx_registry.install_when_onnx_loads)
attach("library_loaded", dynamo.install_when_dynamo_loads)
attach("library_loaded", onnx_registry.install_when_onnx_loads)
