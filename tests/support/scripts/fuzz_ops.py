"""Calls admitted operators with hostile arguments, each call as a loaded
program makes it: a one-node FX graph whose placeholders are the tensors,
checked by the loader's own checks (the call target against the operator
policy, the batch-norm arguments against their input), then run.

argv: cases (JSON file: a list of [case id, "ns::name.overload", seed]), the
CPU seconds this process may use (RLIMIT_CPU) and its address-space limit in
MiB (RLIMIT_AS: a huge allocation fails as an exception instead of taking the
machine), set before torch is imported.

``START <id>`` (flushed) before each case and ``CASE <json>`` after it, so
that the test knows which case a signal killed, and goes on with the rest in
a fresh interpreter. A case's result is "ok", "refused" (the loader's checks
refused the call), "unbuildable" (FX cannot write the call: a loaded program
cannot hold it either) or the name of the exception the call raised.

The arguments of a case are drawn from its seed for each argument of the
schema: plausible values (so that calls reach the kernel) but for up to three
arguments, which get hostile ones: indices far out of range (2**40: an unchecked read
faults), negative and huge sizes and dims, empty, zero-dimensional, expanded
(stride 0), transposed and self-overlapping tensors, the same tensor for two
arguments, and dtypes the op does not expect."""

import json, random, resource, sys

cases, cpu_s, as_mib = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (as_mib << 20, as_mib << 20))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))

import warnings

import torch

from torch_opaque.archive.op_policy import check_batch_norm, check_target

torch.set_num_threads(1)
warnings.simplefilter("ignore")

HUGE = [1 << 40, -(1 << 40), 1 << 62, -(1 << 63), (1 << 63) - 1, 1 << 31, -5, 7]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]  # fmt: skip
STRINGS = ["mean", "sum", "none", "tanh", "reflect", "replicate", "circular", "constant", "left",
           "right", "ij", "xy", "i,j->ij", "ij,jk->ik", "...", "!!", "", "reduced", "complete", "L",
           "U", "gelsy", "floor", "trunc", "amax", "prod", "fro", "nuc", "backward", "ortho"]  # fmt: skip


def plain_tensor(r: random.Random):
    shape = r.choice([(2, 3), (3,), (2, 3), (1, 2, 4, 4), (1, 2, 4), (3, 3), (2, 2, 2, 2, 2)])
    return torch.randn(shape)


def index_tensor(r: random.Random, hostile: bool):
    if not hostile:
        return torch.randint(0, 2, r.choice([(2, 3), (3,), (2,)]))
    values = [r.choice(HUGE + [0, 1, 2, 3, -1]) for _ in range(r.choice([1, 3, 6]))]
    values[0] = r.choice(HUGE)
    t = torch.tensor(values, dtype=torch.int64)
    return t.view(2, 3) if t.numel() == 6 and r.random() < 0.5 else t


def hostile_tensor(r: random.Random):
    k = r.randrange(11)
    if k == 0:
        return torch.empty(r.choice([(0,), (0, 3), (3, 0), (2, 0, 4)]))
    if k == 1:
        return torch.randn(())
    if k == 2:
        return torch.randn(1, 3).expand(4, 3)  # stride 0
    if k == 3:
        return torch.randn(3, 2).t()  # not contiguous
    if k == 4:
        return torch.randn(8).as_strided((3, 3), (1, 1))  # elements overlap
    if k == 5:
        return index_tensor(r, True)
    if k == 6:
        return torch.randn(2, 3).to(r.choice(DTYPES))
    if k == 7:
        return torch.randn(r.choice([(1, 1, 1, 1, 1, 1), (5, 1), (1, 2, 3, 4, 5)]))
    if k == 8:
        return torch.full((2, 3), r.choice([float("nan"), float("inf"), -1e30]))
    if k == 9:
        return torch.randn(4, 6)[1::2, ::3]  # strided view with an offset
    return torch.ones(2, 3, dtype=torch.bool)


def tensor(r, hostile, name):
    if name in ("index", "indices", "target", "src_index", "offsets", "lengths", "repeats"):
        return index_tensor(r, hostile)
    return hostile_tensor(r) if hostile else plain_tensor(r)


def int_value(r, hostile, name):
    if hostile:
        return r.choice(HUGE + [0, -1])
    if name in ("dim", "dim0", "dim1", "start_dim", "end_dim", "axis"):
        return r.choice([0, 1, -1])
    return r.choice([0, 1, 2, 3])


def int_list(r, hostile):
    if hostile:
        return r.choice([[-1, -1], [1 << 40], [1 << 31, 1 << 31], [0] * 10, [-5], [1, 1 << 62], [],
                         [2, -3], [(1 << 63) - 1, 2]])  # fmt: skip
    return r.choice([[2, 3], [1], [0, 1], [3], [1, 1], [2]])


# plausible values of convolution-like arguments, so that calls reach the kernels
CONV_INTS = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "output_padding": [0, 0], "groups": 1}


# and of recurrent cells (batch 2, input 3, hidden 4): gates per cell kind
CELL_GATES = {"lstm_cell": 4, "gru_cell": 3, "rnn_tanh_cell": 1, "rnn_relu_cell": 1}


def cell_tensor(gates: int, typ: str, name: str):
    shapes = {"input": (2, 3), "hx": (2, 4), "w_ih": (4 * gates, 3), "w_hh": (4 * gates, 4),
              "b_ih": (4 * gates,), "b_hh": (4 * gates,)}  # fmt: skip
    if name not in shapes:
        return None
    if typ == "List[Tensor]":  # lstm_cell's (h, c)
        return [torch.randn(shapes[name]), torch.randn(shapes[name])]
    return torch.randn(shapes[name])


def value(r: random.Random, typ: str, name: str, pool: list, hostile: bool, conv: bool = False, gates: int = 0):
    if typ.startswith("Optional["):
        if r.random() < 0.4:
            return None
        typ = typ[len("Optional[") : -1]
    if gates and not hostile and typ in ("Tensor", "List[Tensor]"):
        t = cell_tensor(gates, typ, name)
        if t is not None:
            return t
    if conv and not hostile and name in CONV_INTS:
        return CONV_INTS[name] if typ == "List[int]" or name == "groups" else 1
    if conv and not hostile and typ == "Tensor" and name in ("weight", "input", "self", "grad_output", "bias"):
        t = torch.randn({"weight": (2, 2, 1, 1), "bias": (2,)}.get(name, (1, 2, 4, 4)))
        pool.append(t)
        return t
    if typ == "Tensor":
        if pool and r.random() < 0.15:
            return r.choice(pool)  # the same tensor as another argument
        t = tensor(r, hostile, name)
        pool.append(t)
        return t
    if typ == "List[Tensor]":
        return [value(r, "Tensor", name, pool, hostile and r.random() < 0.5) for _ in range(r.choice([0, 1, 2, 3]))]
    if typ == "List[Optional[Tensor]]":
        return [None if r.random() < 0.2 else index_tensor(r, hostile) for _ in range(r.choice([1, 2]))]
    if typ == "int":
        return int_value(r, hostile, name)
    if typ == "List[int]":
        return int_list(r, hostile)
    if typ == "bool":
        return r.random() < 0.5
    if typ == "List[bool]":
        return [r.random() < 0.7 for _ in range(r.choice([1, 2, 3, 4]))]
    if typ == "float":
        return r.choice([float("nan"), float("inf"), -1.0, 1e308, 0.0, 2.0**40]) if hostile else r.choice([0.5, 1.0, 2.0])
    if typ in ("number",):
        return r.choice([float("nan"), -(1 << 40), 1e308, True, -1]) if hostile else r.choice([1, 0.5, 2])
    if typ == "List[number]" or typ == "List[float]":
        return [value(r, "float", name, pool, hostile) for _ in range(r.choice([1, 2, 3]))]
    if typ == "ScalarType":
        return r.choice(DTYPES) if hostile else torch.float32
    if typ == "Layout":
        return r.choice([torch.sparse_coo, torch.sparse_csr]) if hostile else torch.strided
    if typ == "Device":
        return torch.device(r.choice(["meta", "cpu"]) if hostile else "cpu")
    if typ == "MemoryFormat":
        return r.choice([torch.channels_last, torch.channels_last_3d, torch.preserve_format, torch.contiguous_format])
    if typ == "str":
        return r.choice(STRINGS)
    if typ == "Generator":
        return None
    raise LookupError(typ)


def build(op, r: random.Random):
    """(graph module, its tensor inputs) of one call of `op` with drawn arguments."""
    pool: list = []
    schema_args = op._schema.arguments
    hostile = set(r.sample(range(len(schema_args)), min(len(schema_args), r.choice([0, 1, 1, 2, 3]))))
    conv = "conv" in op._schema.name
    gates = CELL_GATES.get(op._schema.name.split("::")[-1], 0)
    drawn = [value(r, str(a.real_type), a.name, pool, i in hostile, conv, gates) for i, a in enumerate(schema_args)]
    args = [v for a, v in zip(schema_args, drawn) if not a.kwarg_only]
    kwargs = {a.name: v for a, v in zip(schema_args, drawn) if a.kwarg_only}
    g = torch.fx.Graph()
    tensors, ids = [], {}

    def node_of(v):
        if isinstance(v, torch.Tensor):
            if id(v) not in ids:
                ids[id(v)] = g.placeholder(f"t{len(tensors)}")
                ids[id(v)].meta["val"] = v
                tensors.append(v)
            return ids[id(v)]
        if isinstance(v, list):
            return [node_of(x) for x in v]
        return v

    args = [node_of(a) for a in args]
    kwargs = {k: node_of(v) for k, v in kwargs.items()}
    out = g.call_function(op, tuple(args), kwargs)
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g), tensors


def run(case):
    _, qual, seed = case
    ns, rest = qual.split("::")
    name, overload = rest.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    target = f"torch.ops.{ns}.{name}.{overload}"
    if check_target(target, lambda t: False) is not None:
        return "refused"
    try:
        gm, tensors = build(op, random.Random(seed))
    except SyntaxError:  # FX cannot write a call of this overload ('random_.from'): no module
        return "unbuildable"
    if check_batch_norm(gm, "the fuzz graph") is not None:
        return "refused"
    try:
        gm(*tensors)
    except Exception as e:  # a clean error: what the kernel's checks raise
        return type(e).__name__
    return "ok"


for case in cases:
    print("START " + json.dumps(case[0]), flush=True)
    print("CASE " + json.dumps([case[0], run(case)]), flush=True)
