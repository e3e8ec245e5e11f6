"""Crafted archives: ``torch_opaque.load`` and ``inspect`` run nothing from them.

Every case of the corpus (tests/archive_corpus.py) is loaded and inspected in
a fresh interpreter (the cases batched into a few), and the program run when
it loaded; the child reports per case and step the error type and message,
whether the marker file that any planted payload creates exists, whether the
run changed its inputs, the CPU time and the peak memory. An interpreter that
dies in a case (a crash, or the CPU limit of a case that hangs) fails that
case, and the next cases go on in a fresh interpreter.
"""

import json
import os

import pytest
import torch

import torch_opaque
import archive_corpus as C
from torch_opaque.archive import ArchiveLimits
from opaque_fixtures import archops
from support.processes import run_python

MANIFEST = "/extra/torch_opaque.json"
ALLOW = {"allow": ["opaque_fixtures"]}
ANY = C.ANY
# MiB a step may raise the peak resident size of the imported interpreter
# (Note [Memory measured from the imported interpreter]), every 1 GiB bomb
# included: the whole interpreter once peaked at 504 MiB under a bound of 700
# when torch's import held ~350; an inflated bomb would add 1,024.
PEAK_RISE_MIB = 350


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus_base")
    ep = archops.export_net()
    torch_opaque.save(ep, d / "net.pt2")
    torch_opaque.save(ep, d / "net_sc.pt2", self_contained=True)
    torch.export.save(ep, d / "plain.pt2")
    hop = C.export_hop()
    torch_opaque.save(hop, d / "hop.pt2")
    torch.export.save(hop, d / "plain_hop.pt2")
    return d


def corpus(base, d, marker) -> list:
    """(name, path, load options, expected load, expected inspect); an expectation
    is "ok" or (error type, text the message contains)."""
    net, sc, plain = base / "net.pt2", base / "net_sc.pt2", base / "plain.pt2"
    evil = C.payload_bytes(str(marker))
    raw_evil = C.payload_bytes(str(marker), torch_format=False)
    cases = []

    def case(name, src_or_path, options, load, inspect="ok"):
        cases.append((name, src_or_path, options, load, inspect))

    def graph_cases(prefix, edits, expected):
        """One case per (label, source archive, load options, model JSON edit)."""
        for k, (label, src, opts, fn) in enumerate(edits):
            p = d / f"{prefix}_{k}.pt2"
            C.rewrite(src, p, C.edit_json("/models/model.json", fn))
            case(f"graph: {label}", p, opts, ("ArchiveError", expected))

    # -- pickles in every part that holds one
    for label, src, opts in (("net", net, ALLOW), ("sc", sc, {}), ("plain", plain, {})):
        p = d / f"sample_{label}.pt2"
        C.rewrite(src, p, lambda n, b: evil if "/data/sample_inputs/" in n else b)
        load = ("ArchiveError", "written by torch.export.save") if label == "plain" else "ok"
        case(f"pickled sample inputs ({label})", p, opts, load)

    def pickled_weight(cfg):
        cfg["config"]["a.weight"]["use_pickle"] = True

    for label, src, opts in (("net", net, ALLOW), ("sc", sc, {}), ("plain", plain, {})):
        p = d / f"weight_{label}.pt2"
        edit = C.edit_json("_weights_config.json", pickled_weight)
        C.rewrite(src, p, lambda n, b: evil if n.endswith("/data/weights/weight_0") else edit(n, b))
        # (a plain archive calling opaque ops is refused before its weights are read)
        load = ("ArchiveError", "written by torch.export.save") if label == "plain" else ("ArchiveError", "weight 'a.weight'")
        case(f"pickled weight ({label})", p, opts, load)
    p = d / "weight_plain_no_opaque.pt2"
    edit = C.edit_json("_weights_config.json", lambda cfg: cfg["config"]["l.weight"].update(use_pickle=True))
    C.rewrite(base / "plain_hop.pt2", p, lambda n, b: evil if n.endswith("/data/weights/weight_0") else edit(n, b))
    case("pickled weight (plain, no opaque op)", p, {}, ("ArchiveError", "weight 'l.weight'"))

    root = C.root_of(net)
    p = d / "weight_rawpickle.pt2"
    C.rewrite(net, p, lambda n, b: raw_evil if n.endswith("/data/weights/weight_0") else
              C.edit_json("_weights_config.json", pickled_weight)(n, b))  # fmt: skip
    case("pickled weight, plain pickle format", p, ALLOW, ("ArchiveError", "refuses"))

    def custom_obj(cfg):
        cfg["config"]["evil"] = {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}

    for prefix in ("custom_obj_0", "opaque_obj_0", "tensor_constant_0"):
        p = d / f"const_{prefix}.pt2"

        def cfg_edit(cfg, prefix=prefix):
            custom_obj(cfg)
            cfg["config"]["evil"]["path_name"] = prefix

        C.rewrite(net, p, C.edit_json("_constants_config.json", cfg_edit),
                  add=[C.stored(f"{root}data/constants/{prefix}", raw_evil if "obj" in prefix else evil)])  # fmt: skip
        frag = "refuses" if prefix.startswith("tensor") else "custom or opaque object"
        case(f"constant {prefix}", p, ALLOW, ("ArchiveError", frag))

    p = d / "legacy_weights.pt2"
    C.rewrite(net, p, lambda n, b: b, add=[C.stored(f"{root}data/weights/model.pt", evil)])
    case("legacy pickled weights file", p, ALLOW, ("ArchiveError", "legacy pickled format"))

    # -- inside stored programs
    p = d / "sc_inner_sample.pt2"
    C.edit_stored_program(sc, p, "fwd", lambda n, b: evil if "/data/sample_inputs/" in n else b)
    case("stored program: pickled sample inputs", p, {}, "ok")
    p = d / "sc_inner_const.pt2"
    C.edit_stored_program(
        sc, p, "fwd", C.edit_json("_constants_config.json", custom_obj),
        inner_add=[lambda r: C.stored(f"{r}data/constants/custom_obj_0", raw_evil)],
    )  # fmt: skip
    case("stored program: custom object", p, {}, ("ArchiveError", "custom or opaque object"))

    def evil_target(model):
        C.first_node_target(model)["target"] = "torch.os.system"

    p = d / "sc_inner_target.pt2"
    C.edit_stored_program(sc, p, "bwd", C.edit_json("/models/model.json", evil_target))
    case("stored program: non-operator call", p, {},
         ("ArchiveError", ("stored bwd program", "'torch.os.system' is not an operator a loaded program may call")))  # fmt: skip

    # -- the graph itself
    p = d / "target.pt2"
    C.rewrite(net, p, C.edit_json("/models/model.json", evil_target))
    case("graph: non-operator call", p, ALLOW, ("ArchiveError", "'torch.os.system' is not an operator a loaded program may call"))

    def evil_expr(model):
        text = json.dumps(model)
        sym = text[text.index("Symbol(") : text.index(")", text.index("Symbol(")) + 1]
        new = json.loads(text.replace(sym, f"__import__('builtins').open({str(marker)!r}, 'w')"))
        model.clear()
        model.update(new)

    p = d / "expr.pt2"
    C.rewrite(net, p, C.edit_json("/models/model.json", evil_expr))
    case("graph: code in a symbolic expression", p, ALLOW, ("ArchiveError", "not plain arithmetic"))

    def evil_guard(model):
        model["guards_code"] = [f"__import__('builtins').open({str(marker)!r}, 'w') is None"]

    p = d / "guard.pt2"
    C.rewrite(net, p, C.edit_json("/models/model.json", evil_guard))
    case("graph: code in a guard", p, ALLOW, ("ArchiveError", "not a plain check of input sizes"))
    p = d / "sc_inner_guard.pt2"
    C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json", evil_guard))
    case("stored program: code in a guard", p, {}, ("ArchiveError", "not a plain check of input sizes"))

    # -- zip bombs, one per entry kind (1 GiB of spaces each), and lying headers
    for label, suffix, src, opts in (
        ("manifest", MANIFEST, net, ALLOW),
        ("model.json", "/models/model.json", net, ALLOW),
        ("weight", "/data/weights/weight_0", net, ALLOW),
        ("stored program", "/extra/torch_opaque.program.1.fwd", sc, {}),
    ):
        p = d / f"bomb_{label}.pt2"
        entries = [C.bomb(e.name) if e.name.endswith(suffix) else e for e in C.read_entries(src)]
        C.write_zip(p, entries)
        inspect = "ok" if label in ("weight", "stored program") else ("InspectError", "limit")
        case(f"zip bomb: {label}", p, opts, ("ArchiveError", "limit"), inspect)
        p = d / f"bomb_lying_{label}.pt2"
        entries = [C.bomb(e.name, declared=len(e.data)) if e.name.endswith(suffix) else e for e in C.read_entries(src)]
        C.write_zip(p, entries)
        inspect = "ok" if label in ("weight", "stored program") else ("InspectError", "fails its CRC check")
        case(f"lying header: {label}", p, opts, ("ArchiveError", "fails its CRC check"), inspect)
    p = d / "bomb_inner.pt2"
    C.edit_stored_program(sc, p, "fwd", lambda n, b: None if n.endswith("/models/model.json") else b,
                          inner_add=[lambda r: C.bomb(f"{r}models/model.json")])  # fmt: skip
    case("zip bomb inside a stored program", p, {}, ("ArchiveError", "limit"))

    # -- names, truncation, garbage, not pt2
    for label, name in (("dotdot", "../../evil.txt"), ("absolute", "/etc/evil"), ("backslash", "..\\evil")):
        p = d / f"name_{label}.pt2"
        full = name if name.startswith("/") else root + name
        C.rewrite(net, p, lambda n, b: b, add=[C.stored(full, b"x")])
        case(f"entry name: {label}", p, ALLOW, ("ArchiveError", "crafted or corrupted"), ("InspectError", "crafted"))
    data = net.read_bytes()
    for label, blob in (("truncated", data[: len(data) // 2]), ("garbage", os.urandom(4096)), ("empty", b"")):
        p = d / f"{label}.pt2"
        p.write_bytes(blob)
        case(f"file: {label}", p, ALLOW, ("ArchiveError", "truncated or corrupted"), ("InspectError", "cannot read"))
    p = d / "two_roots.pt2"
    C.rewrite(net, p, lambda n, b: b, add=[C.stored("other/x", b"x")])
    case("file: two top folders", p, ALLOW, ("ArchiveError", "not a .pt2 archive"), ("InspectError", "not a .pt2"))
    p = d / "no_manifest_no_model.pt2"
    C.rewrite(net, p, lambda n, b: None if n.endswith(".json") else b)
    case("file: no model", p, ALLOW, ("ArchiveError", "holds no exported program"), ("InspectError", "no exported"))

    # -- manifest fields edited one by one (self-contained: every field is used)
    sc_manifest = C.manifest_of(sc)
    edits = [
        ("format", "other", "format 'torch_opaque.archive'"),
        ("version", 99, "version 99"),
        ("version", "2", "field version"),
        ("self_contained", "yes", "field self_contained"),
        ("ops", {}, "field ops"),
        ("ops[0]", [], "field ops[0]"),
        ("ops[0].namespace", "bad ns", "field ops[0].namespace"),
        ("ops[0].name", "A.B", "field ops[0].name"),
        ("ops[0].module", "os; import x", "field ops[0].module"),
        ("ops[0].class", "x(y)", "field ops[0].class"),
        ("ops[0].defined_in", "rust", "field ops[0].defined_in"),
        ("ops[0].overloads", [], "field ops[0].overloads"),
        ("ops[0].overloads[0].overload", "a b", "field ops[0].overloads[0].overload"),
        ("ops[0].overloads[0].schema", "garbage(", "field ops[0].overloads[0].schema"),
        ("ops[0].overloads[0].schema", "opaque::Other.Tensor(Tensor x) -> Tensor", "field ops[0].overloads[0].schema"),
        ("ops[0].overloads[0].arguments", "Tensor y", "field ops[0].overloads[0].arguments"),
        ("ops[0].overloads[0].n_out", 0, "field ops[0].overloads[0].n_out"),
        ("ops[0].overloads[0].n_out", 3, "field ops[0].overloads[0].n_out"),
        ("ops[0].overloads[0].tokens", ["os.system"], "field ops[0].overloads[0].tokens[0]"),
        ("ops[0].overloads[0].calls", {"op": -1}, "field ops[0].overloads[0].calls.op"),
        ("ops[0].overloads[0].variants", "x", "field ops[0].overloads[0].variants"),
        ("ops[0].overloads[0].variants[0].id", 7, "field ops[0].overloads[0].variants[0].id"),
        ("ops[0].overloads[0].variants[0].args", [], "field ops[0].overloads[0].variants[0].args"),
        ("ops[0].overloads[0].variants[0].args[0].kind", "weird", "variants[0].args[0].kind"),
        ("ops[0].overloads[0].variants[0].args[0].dtype", "os", "variants[0].args[0].dtype"),
        ("ops[0].overloads[0].variants[0].args[0].shape", [-1], "variants[0].args[0].shape[0]"),
        ("ops[0].overloads[0].variants[0].saved", [[9, 0, 0]], "variants[0].saved[0][0]"),
        ("ops[0].overloads[0].variants[0].saved", [[1, 5, 0]], "variants[0].saved[0]"),
        ("ops[0].overloads[0].variants[0].n_residuals", "1", "variants[0].n_residuals"),
        ("ops[0].overloads[0].variants[0].grads", [4], "variants[0].grads[0]"),
        ("ops[0].overloads[0].variants[0].non_differentiable", [1], "variants[0].non_differentiable[0]"),
        ("ops[0].overloads[0].variants[0].fwd", "../../x", "variants[0].fwd"),
        ("ops[0].overloads[0].variants[0].fwd", "torch_opaque.program.99.fwd", "lacks the stored program"),
        ("ops[2].overloads[0].variants[0].args[1].value", {"dtype": "os"}, "unknown dtype 'os'"),
        ("ops[2].overloads[0].variants[0].args[1].value", {"eval": "1"}, "unknown value tag 'eval'"),
        ("ops[2].overloads[0].variants[0].args[1].value", {"device": "cpu; rm"}, "unknown device"),
    ]
    assert sc_manifest["ops"][2]["name"] == "ArchScaledSin"
    for k, (path, value, frag) in enumerate(edits):
        m = json.loads(json.dumps(sc_manifest))
        C.set_path(m, path, value)
        p = d / f"manifest_{k}.pt2"
        C.with_manifest(sc, p, m)
        inspect = "ok" if frag == "lacks the stored program" else ("InspectError", frag)
        case(f"manifest {path} = {value!r}", p, {}, ("ArchiveError", frag), inspect)

    # -- the review's attacks (each payload, where it can, creates the marker;
    # the child's working directory is the marker's folder, so a relative name
    # reaches it from strings that may not hold a '/')
    assert marker.parent == d
    rel = marker.name
    hop = base / "hop.pt2"

    # (a) symbolic expressions: sympy parsed them (S() re-parses a string, whose
    # attribute chains reach builtins; 9**9**9 never finishes)
    live_expr = f"S('Integer.__new__.__builtins__.get')('open')('{rel}', 'w')"
    exprs = [
        ("S() reaching builtins", live_expr),
        ("S() of code", "S('__import__(\"os\").system(\"touch marker\")')"),
        ("nested Pow", "Pow(Integer(9), Pow(Integer(9), Integer(9)))"),
        ("9**9**9", "9**9**9"),
    ]
    for k, (label, expr) in enumerate(exprs):
        p = d / f"sym_{k}.pt2"
        C.rewrite(net, p, C.edit_json("/models/model.json", lambda m, e=expr: C.replace_expr(m, e)))
        case(f"graph: symbolic expression, {label}", p, ALLOW, ("ArchiveError", "symbolic expression"))
    for k, (label, expr) in enumerate(exprs[::2]):
        p = d / f"sc_sym_{k}.pt2"
        C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json", lambda m, e=expr: C.replace_expr(m, e)))
        case(f"stored program: symbolic expression, {label}", p, {}, ("ArchiveError", "symbolic expression"))

    # (b) names that FX writes into the source of forward(): a default value of
    # an (unused) placeholder runs when the GraphModule is built; a quote in a
    # get_attr target or a keyword name runs when the program is called
    name_cases = [
        ("placeholder with a default", net, ALLOW, lambda m: C.add_placeholder(m, f"y=open('{rel}', 'w')", "x")),
        ("placeholder with \\r", net, ALLOW,
         lambda m: C.rename_value(m, "x", f"x\r__import__('builtins').open('{rel}', 'w')\r")),
        ("value name with \\r", net, ALLOW,
         lambda m: C.rename_value(m, "linear", f"linear\r__import__('builtins').open('{rel}', 'w')\r")),
        ("value name with a quote", net, ALLOW, lambda m: C.rename_value(m, "add", f'add"); open("{rel}", "w"); ("')),
        ("graph name with a quote", hop, {}, lambda m: C.hop_node(m)["inputs"][1]["arg"]["as_graph"].update(
            name=f"submod_1\") if open('{rel}', 'w') else getattr(self, \"submod_1")),
        ("graph name with \\r", hop, {}, lambda m: C.hop_node(m)["inputs"][1]["arg"]["as_graph"].update(
            name=f"submod_1\ropen('{rel}', 'w')\r")),
        ("keyword argument name", hop, {}, lambda m: C.hop_node(m)["inputs"].append(
            {"name": f"k = open('{rel}', 'w'), j", "arg": {"as_int": 1}, "kind": 2})),
        ("forward_arg_names", net, ALLOW, lambda m: m["graph_module"]["module_call_graph"][0]["signature"].update(
            forward_arg_names=[f"x=open('{rel}', 'w')"])),
    ]  # fmt: skip
    graph_cases("names", name_cases, "is not a valid name")
    p = d / "sc_names_placeholder.pt2"
    C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json",
                          lambda m: C.add_placeholder(m, f"y=open('{rel}', 'w')", "flat_0")))  # fmt: skip
    case("stored program: placeholder with a default", p, {}, ("ArchiveError", "is not a valid name"))

    # (c) operators: passed as arguments (as_operator) to higher-order ops, and
    # those that touch files, storage or the profiler
    def from_file_node(m):
        m["graph_module"]["graph"]["tensor_values"]["ff"] = {
            "dtype": 7, "sizes": [{"as_int": 4}], "requires_grad": False, "device": {"type": "cpu", "index": None},
            "strides": [{"as_int": 1}], "storage_offset": {"as_int": 0}, "layout": 7,
        }  # fmt: skip
        args = [("filename", {"as_string": rel}, 1), ("shared", {"as_bool": True}, 1), ("size", {"as_int": 4}, 1)]
        return C.call_node("torch.ops.aten.from_file.default", args, ["ff"])

    def wrapped(m, op):
        node = from_file_node(m)
        node["target"] = "torch.ops.higher_order.wrap"
        node["inputs"] = [{"name": "", "arg": {"as_operator": op}, "kind": 1}] + [
            dict(a, name="") for a in node["inputs"]
        ]
        node["is_hop_single_tensor_return"] = True
        return node

    def profiler_node(m):
        node = from_file_node(m)
        node["target"] = "torch.ops.profiler._record_function_enter_new.default"
        node["inputs"] = [{"name": "name", "arg": {"as_string": "x"}, "kind": 1}]
        node["outputs"] = [{"as_custom_obj": {"name": "ff", "class_fqn": "__torch__.torch.classes.profiler._RecordFunction"}}]
        return node

    op_cases = [
        ("as_operator os.system in wrap_with_set_grad_enabled", hop, {},
         lambda m: C.hop_node(m)["inputs"].append({"name": "", "arg": {"as_operator": "torch.os.system"}, "kind": 1})),
        ("as_operator aten.from_file in wrap", net, ALLOW,
         lambda m: C.graph_of(m)["nodes"].insert(0, wrapped(m, "torch.ops.aten.from_file.default"))),
        ("as_operator os.system in wrap", net, ALLOW,
         lambda m: C.graph_of(m)["nodes"].insert(0, wrapped(m, "torch.os.system"))),
        ("aten.from_file", net, ALLOW, lambda m: C.graph_of(m)["nodes"].insert(0, from_file_node(m))),
        ("profiler op", net, ALLOW, lambda m: C.graph_of(m)["nodes"].insert(0, profiler_node(m))),
    ]  # fmt: skip
    graph_cases("ops", op_cases, "not an operator a loaded program may call")
    p = d / "sc_ops_from_file.pt2"
    C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json",
                          lambda m: C.graph_of(m)["nodes"].insert(0, from_file_node(m))))  # fmt: skip
    case("stored program: aten.from_file", p, {}, ("ArchiveError", "not an operator a loaded program may call"))

    # (d) stored programs that write to their inputs: ArchCube's forward gets a
    # view of the caller's x (x[:, :4]), so running the loaded program would
    # change the caller's tensor
    cube_fwd = C.stored_program_name(sc, "ArchCube", "fwd")

    def fill_input(m):
        g = C.graph_of(m)
        g["tensor_values"]["filled"] = json.loads(json.dumps(g["tensor_values"]["flat_0"]))
        g["nodes"].insert(0, C.call_node("torch.ops.aten.fill_.Scalar",
                                         [("self", C.tensor("flat_0"), 1), ("value", {"as_float": 0.0}, 1)], ["filled"]))  # fmt: skip

    def set_and_fill_input(m):
        g = C.graph_of(m)
        for n in ("copied", "repointed"):
            g["tensor_values"][n] = json.loads(json.dumps(g["tensor_values"]["flat_0"]))
        fill_input(m)
        g["nodes"][:0] = [
            C.call_node("torch.ops.aten.clone.default", [("self", C.tensor("flat_0"), 1)], ["copied"]),
            C.call_node("torch.ops.aten.set_.source_Tensor",
                        [("self", C.tensor("flat_0"), 1), ("source", C.tensor("copied"), 1)], ["repointed"]),
        ]  # fmt: skip

    def declared_mutation(m):
        g = C.graph_of(m)
        out = g["outputs"][0]["as_tensor"]["name"]
        g["outputs"].insert(0, C.tensor(out))
        m["graph_module"]["signature"]["output_specs"].insert(
            0, {"user_input_mutation": {"arg": {"name": out}, "user_input_name": "flat_0"}}
        )

    for label, fn, frag in (
        ("fill_ of its input", fill_input, "mutates"),
        # set_ is refused as an operator before the program is deserialized
        ("set_ and fill_ of its input", set_and_fill_input, "not an operator a loaded program may call"),
        ("an input mutation in its signature", declared_mutation, "mutates"),
    ):
        p = d / f"sc_mutates_{label.split()[0]}.pt2"
        C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json", fn), program=cube_fwd)
        case(f"stored program: {label}", p, {}, ("ArchiveError", frag))

    # (e) a pickled sparse weight whose index lies outside its size
    p = d / "sparse_weight.pt2"
    sparse = C.sparse_parameter_bytes()
    edit = C.edit_json("_weights_config.json", pickled_weight)
    C.rewrite(net, p, lambda n, b: sparse if n.endswith("/data/weights/weight_0") else edit(n, b))
    case("pickled sparse weight, index out of range", p, ALLOW, ("ArchiveError", "sparse"))

    # (f) resources: a weight of 1 GiB declared, 0 bytes stored; 200k directory
    # records; a graph of more nodes than ArchiveLimits.nodes
    def gib_weight(cfg):
        meta = cfg["config"]["a.weight"]["tensor_meta"]
        meta["sizes"] = [{"as_int": 256}, {"as_int": 1024}, {"as_int": 1024}]
        meta["strides"] = [{"as_int": 1 << 20}, {"as_int": 1024}, {"as_int": 1}]

    p = d / "empty_gib_weight.pt2"
    edit = C.edit_json("_weights_config.json", gib_weight)
    C.rewrite(net, p, lambda n, b: b"" if n.endswith("/data/weights/weight_0") else edit(n, b))
    case("weight: 1 GiB declared, 0 bytes stored", p, ALLOW, ("ArchiveError", ("weight 'a.weight'", "bytes")))
    for zip64 in (True, False):
        p = d / f"records_{zip64}.pt2"
        C.write_many_records(p, 200_001, zip64=zip64)
        label = "zip64 end record" if zip64 else "end record saying 65535"
        case(f"zip: 200k directory records, {label}", p, ALLOW, ("ArchiveError", "entries"), ("InspectError", "entries"))

    n_nodes = getattr(ArchiveLimits(), "nodes", 100_000) + 1

    def many_nodes(m):
        node = C.call_node("torch.ops.aten.neg.default", [("self", C.tensor("x"), 1)], ["n"])
        nodes = C.graph_of(m)["nodes"]
        for i in range(n_nodes - len(nodes)):
            nodes.append(dict(node, outputs=[C.tensor(f"n{i}")], name=f"n{i}"))

    p = d / "many_nodes.pt2"
    C.rewrite(net, p, C.edit_json("/models/model.json", many_nodes))
    case("graph: more nodes than ArchiveLimits.nodes", p, ALLOW, ("ArchiveError", ("nodes", "limit")), ANY)

    # (g) integers of 5000 digits (Python refuses > 4300 with a ValueError naming nothing)
    big = "9" * 5000
    p = d / "bigint_manifest.pt2"
    C.rewrite(sc, p, C.edit_text(MANIFEST, r'"version": \d+', f'"version": {big}'))
    case("manifest: a 5000-digit integer", p, {}, ("ArchiveError", "torch_opaque.json"), ("InspectError", "torch_opaque.json"))
    p = d / "bigint_model.pt2"
    C.rewrite(net, p, C.edit_text("/models/model.json", r'"major": \d+', f'"major": {big}'))
    case("graph: a 5000-digit integer", p, ALLOW, ("ArchiveError", "model.json"), ("InspectError", "model.json"))
    p = d / "bigint_weights_config.pt2"
    C.rewrite(net, p, C.edit_text("_weights_config.json", r'"as_int": \d+', f'"as_int": {big}'))
    case("weights config: a 5000-digit integer", p, ALLOW, ("ArchiveError", "model_weights_config.json"))
    p = d / "bigint_stored.pt2"
    C.edit_stored_program(sc, p, "fwd", C.edit_text("/models/model.json", r'"as_int": \d+', f'"as_int": -{big}'))
    case("stored program: a 5000-digit integer", p, {}, ("ArchiveError", "model.json"))

    # -- found by tests/archive/test_archive_fuzz.py
    # (torch._C.parse_schema raises TypeError for a lone surrogate, which JSON
    # can write, and UnicodeDecodeError for some non-ASCII text)
    for k, (label, tail) in enumerate((("a lone surrogate", "\ud800"), ("U+202E", "\u202e"))):
        m = json.loads(json.dumps(sc_manifest))
        m["ops"][1]["overloads"][0]["schema"] += tail
        p = d / f"manifest_unicode_{k}.pt2"
        C.with_manifest(sc, p, m)
        frag = "field ops[1].overloads[0].schema"
        case(f"manifest: {label} in a schema", p, {}, ("ArchiveError", frag), ("InspectError", frag))
    p = d / "sc_fqn.pt2"
    C.edit_stored_program(sc, p, "fwd", C.edit_json("/models/model.json",
                          lambda m: m["graph_module"]["module_call_graph"][0].update(fqn="builtins.exec")))  # fmt: skip
    case("stored program: module_call_graph[0].fqn not ''", p, {}, ("ArchiveError", "stored fwd program"))
    return cases


def test_payload_is_live(tmp_path):
    assert C.check_payload_is_live(tmp_path / "marker")


def test_crafted_archives_run_nothing(base, tmp_path):
    marker = tmp_path / "marker"
    cases = corpus(base, tmp_path, marker)
    assert len(cases) > 60
    assert len({c[0] for c in cases}) == len(cases)
    results = {}
    # One interpreter for the cases that may import nothing (no real op is ever
    # registered there, so self-contained archives use their stored programs),
    # one for those that allow the defining module.
    for batch in ([c for c in cases if not c[2]], [c for c in cases if c[2]]):
        results.update(C.run_cases(batch, tmp_path, marker))
    failures = C.check_results(cases, results, PEAK_RISE_MIB)
    steps = [(r.get(w + "_peak_rise_mib", 0), r.get(w + "_cpu_s", 0), f"{n}: {w}") for n, r in results.items() for w in ("load", "inspect", "run")]
    print(f"{len(cases)} cases; highest rises of the peak (MiB): " + "; ".join(f"{p:.0f} {s}" for p, _, s in sorted(steps)[-4:]))
    print("most CPU (s): " + "; ".join(f"{c:.1f} {s}" for _, c, s in sorted(steps, key=lambda x: x[1])[-4:]))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    assert not marker.exists()


def test_inspect_command_on_a_bomb(base, tmp_path):
    """The command itself: exit status 1 and one line naming the entry, no MemoryError."""
    p = tmp_path / "bomb.pt2"
    entries = [C.bomb(e.name) if e.name.endswith("/models/model.json") else e for e in C.read_entries(base / "net.pt2")]
    C.write_zip(p, entries)
    proc = run_python(module="torch_opaque", args=["inspect", p], cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("python -m torch_opaque inspect: error: torch_opaque: entry 'net/models/model.json'")
    assert "inflates to 1073741824 bytes, more than the model limit" in proc.stderr
    assert "Traceback" not in proc.stderr
