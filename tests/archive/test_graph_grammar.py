"""The graph grammar (torch_opaque/archive/graph_grammar.py) and the operator
policy (op_policy.py) on real serialized programs: what torch writes passes
and loads; each kind of crafted part is refused by name before torch's
deserializer sees it."""

import copy
import json

import pytest
import torch
from torch._export.serde import serialize

from torch_opaque.archive.graph_grammar import check_name, check_program_json
from torch_opaque.archive.op_policy import check_stored_graph, check_target
from torch_opaque.archive.program import check_model_json, deserialize
from torch_opaque.archive.zipio import ArchiveLimits
from torch_opaque.errors import ArchiveError

from archive_corpus import json_objects


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        y = self.lin(x) * self.scale
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,)), y.shape[0] * 2


def _program():
    ep = torch.export.export(Net(), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim("b")},))
    return ep, json.loads(serialize.serialize(ep).exported_program)


@pytest.fixture(scope="module")
def program():
    return _program()


def check(model, **kw):
    return check_model_json(model, "models/model.json", "f.pt2", {}, **kw)


def test_what_torch_writes_passes_and_loads_the_same(program):
    ep, model = program
    model = copy.deepcopy(model)
    targets = check(model).targets
    assert "torch.ops.aten.linear.default" in targets and "torch.ops.higher_order.cond" in targets
    loaded = deserialize(model, (ep.state_dict, ep.constants), "f.pt2", "models/model.json", {})
    x = torch.randn(5, 4)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(loaded.module()(x), ep.module()(x)))  # fmt: skip
    # the expressions reached the deserializer as sympy objects, and are the same symbols
    assert str(loaded.range_constraints) == str(ep.range_constraints)


def nodes(model):
    return model["graph_module"]["graph"]["nodes"]


def edited(program, fn):
    model = copy.deepcopy(program[1])
    fn(model)
    return model


def _first_expr(model):
    return next(o for o in json_objects(model) if isinstance(o.get("expr_str"), str))


CASES = {
    "\\r in a value name": (lambda m: m["graph_module"]["graph"]["outputs"][1]["as_sym_int"].update(as_name="y\rimport os"),
                            "graph.outputs[1].as_sym_int.as_name: it is not a valid name"),
    "quote in a keyword name": (lambda m: nodes(m)[0]["inputs"][0].update(name='x=1)\nimport os #'),
                                "inputs[0].name: it is not a valid name"),
    "code in a get_attr path": (
        lambda m: m["graph_module"]["signature"]["input_specs"][0]["parameter"].update(parameter_name='lin")\nimport os#'),
        "parameter_name: it is not a dotted path"),
    "non-ASCII identifier": (lambda m: nodes(m)[0].update(name="ﬁx"), "name: it is not a valid name"),
    "keyword as a name": (lambda m: m["graph_module"]["graph"]["inputs"][-1]["as_tensor"].update(name="lambda"),
                          "it is a Python keyword"),
    "sympy S() in an expression": (lambda m: _first_expr(m).update(expr_str="S('__import__(\"os\")')"),
                                   "is not plain arithmetic of sizes (unknown name 'S' at offset 0)"),
    "9**9**9 in an expression": (lambda m: _first_expr(m).update(expr_str="Pow(Integer(9), Pow(Integer(9), Integer(9)))"),
                                 "Pow with an exponent of 387420489"),
    "non-operator target": (lambda m: nodes(m)[0].update(target="torch.os.system"),
                            "'torch.os.system' is not an operator a loaded program may call"),
    "file op": (lambda m: nodes(m)[0].update(target="torch.ops.aten.from_file.default"),
                "reads or writes files or storage"),
    "set_": (lambda m: nodes(m)[0].update(target="torch.ops.aten.set_.source_Tensor"), "reads or writes files"),
    "profiler namespace": (lambda m: nodes(m)[0].update(target="torch.ops.profiler._record_function_enter.default"),
                           "the profiler namespace acts outside the computation"),
    "print HOP": (lambda m: nodes(m)[0].update(target="torch.ops.higher_order.print"),
                  "a higher-order operator that prints"),
    "operator as an argument": (
        lambda m: nodes(m)[0]["inputs"].append({"name": "op", "arg": {"as_operator": "torch.os.system"}, "kind": 1}),
        "arg.as_operator: 'torch.os.system' is not an operator"),
    "unregistered custom op": (lambda m: nodes(m)[0].update(target="torch.ops.evil.x.default"),
                               "import the library that defines evil::x"),
    "unknown field": (lambda m: nodes(m)[0].update(extra=1), "Node has no such field in torch's schema"),
    "two tags in a union": (lambda m: nodes(m)[0]["inputs"][0]["arg"].update(as_int=1),
                            "a Argument is an object with one key"),
    "int out of int64": (lambda m: nodes(m)[0]["inputs"].append({"name": "k", "arg": {"as_int": 1 << 70}, "kind": 1}),
                         "not an integer in the int64 range"),
    "control character in metadata": (lambda m: nodes(m)[0]["metadata"].update(nn_module_stack="a\rb"),
                                      "holds the control character '\\r'"),
    "bidi override in a stack trace": (lambda m: nodes(m)[0]["metadata"].update(stack_trace="x\u202ey"),
                                       "holds the control character '\\u202e'"),
    "code in a guard": (lambda m: m.update(guards_code=["__import__('os').system('x') is None"]),
                        "is not a plain check of input sizes"),
    "bad range key": (lambda m: m["range_constraints"].update({"s0'); import os; ('": {"min_val": 0, "max_val": 1}}),
                      "(this key) it is not a size expression"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_crafted_parts_are_refused_naming_the_part(program, name):
    edit, frag = CASES[name]
    model = edited(program, edit)
    with pytest.raises(ArchiveError) as e:
        check(model)
    msg = str(e.value)
    assert msg.startswith("torch_opaque.load: models/model.json in f.pt2 is not a program torch_opaque loads: program.")
    assert frag in msg, msg


def test_node_count_is_bounded(program):
    model = copy.deepcopy(program[1])
    n = check_program_json(model, "m", "f", ArchiveLimits(), {}, lambda t: False).nodes
    assert n > len(nodes(model))  # the nodes of cond's branches count too
    check(copy.deepcopy(program[1]), limits=ArchiveLimits(nodes=n))
    with pytest.raises(ArchiveError, match=rf"more than {n - 1} nodes \(raise it with limits=ArchiveLimits\(nodes=...\)"):
        check(copy.deepcopy(program[1]), limits=ArchiveLimits(nodes=n - 1))


def test_guards_are_rewritten_from_the_checked_tree(program):
    model = edited(program, lambda m: m.update(guards_code=["L['x'].size()[0]   >=  2"]))
    assert check(model).program.guards_code == ["L['x'].size()[0] >= 2"]


def test_described_and_registered_custom_ops():
    def custom_ok(t):
        return t == "torch.ops.opaque.Foo.Tensor"

    assert check_target("torch.ops.opaque.Foo.Tensor", custom_ok) is None
    assert "does not describe it" in check_target("torch.ops.opaque.Bar.Tensor", custom_ok)
    assert check_target("torch.ops.aten.add.Tensor", custom_ok) is None
    assert check_target("_operator.add", custom_ok) is None
    assert check_target("torch.ops.higher_order.wrap_with_set_grad_enabled", custom_ok) is None
    assert "names its overload" in check_target("torch.ops.aten.add", custom_ok)
    assert check_name("x_1") is None and check_name("1x") is not None


class _Stored(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "inplace":
            x.mul_(2)
            return x + 1
        if self.how == "view":
            x.view(-1)[0:1].fill_(0)
            return x + 1
        y = x.clone()
        y.add_(1)  # a fresh tensor: fine
        return y


@pytest.mark.parametrize("how, bad", [("inplace", True), ("view", True), ("fresh", False)])
def test_stored_programs_may_not_write_their_inputs(how, bad):
    ep = torch.export.export(_Stored(how), (torch.randn(3),))
    why = check_stored_graph(ep.graph_module, "prog")
    if bad:
        assert why is not None and "writes to its input" in why and "mutates its inputs" in why, why
    else:
        assert why is None, why
