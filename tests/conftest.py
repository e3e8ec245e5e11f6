import pytest
import torch


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
    graph = getattr(graph_module_or_graph, "graph", graph_module_or_graph)
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and name in str(getattr(n.target, "__name__", n.target))
    ]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
