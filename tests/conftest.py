import pytest
import torch

# examples/cpp's ops library, built by scripts/dev.sh against the installed
# CMake package: example::scaled_sin, top_value, weighted_sum, power_means,
# threshold_select, scaled_arange (in the build tree of this interpreter's
# torch release: Note [One build tree per torch release]).
from support.build_tree import EXAMPLE_OPS_LIB, missing


@pytest.fixture(scope="module")
def example_ops():
    """Loads EXAMPLE_OPS_LIB (once per process; later loads are no-ops)."""
    import torch_opaque

    assert EXAMPLE_OPS_LIB.exists(), missing(EXAMPLE_OPS_LIB)
    torch_opaque.load_library(EXAMPLE_OPS_LIB)


def op_calls(graph_module_or_graph, fn_name: str, namespace: str = "opaque") -> list:
    """call_function nodes whose target is one of `fn_name`'s ops (main, _fwd, _bwd)."""
    graph = getattr(graph_module_or_graph, "graph", graph_module_or_graph)
    out = []
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        ns, _, name = n.target._schema.name.partition("::")
        if ns == namespace and name in (fn_name, fn_name + "_fwd", fn_name + "_bwd"):
            out.append(n)
    return out


def aten_calls(graph_module_or_graph, name: str) -> list:
    """Calls of the ATen op / torch function / tensor method `name` (e.g. "sin")."""
    graph = getattr(graph_module_or_graph, "graph", graph_module_or_graph)
    found = []
    for n in graph.nodes:
        t = n.target
        if n.op == "call_method" and t == name:
            found.append(n)
        elif n.op == "call_function":
            if isinstance(t, torch._ops.OpOverload):
                if t.namespace == "aten" and t._opname == name:
                    found.append(n)
            elif getattr(t, "__name__", None) == name:
                found.append(n)
    return found


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
