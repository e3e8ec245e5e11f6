"""Reading the exported programs of a .pt2 archive as data: no pickle is run.

Note [Reading pt2 without unpickling]
``torch.export.load`` unpickles parts of an archive: the sample inputs, weights
and constants marked ``use_pickle`` (falling back to ``weights_only=False``),
custom objects (TorchScript pickles) and opaque objects (``pickle.loads``).
Its graph deserializer also hands expression strings to ``sympy.sympify``
(which evaluates them) and resolves call targets by walking ``getattr`` from
the ``torch``, ``math`` and ``operator`` modules. torch_opaque therefore reads
the archive itself, following the layout written by torch/export/pt2_archive:

* ``models/<name>.json`` is parsed as JSON and read against a closed grammar
  before torch's deserializer sees it (Note [The graph grammar] in
  graph_grammar.py): names are identifiers, call targets operators a loaded
  program may call (Note [Operators a loaded program may call] in
  op_policy.py), symbolic expressions are parsed by our own parser into sympy
  objects (sym_expr.py), guards are checked comparisons of input sizes. After
  deserialization every call is checked again to be an OpOverload, a
  HigherOrderOperator or a symbolic-size operator, and a stored program may
  not write to its inputs;
* weights and tensor constants are rebuilt from their raw bytes and the tensor
  metadata of ``data/*/<name>_*_config.json``; a payload torch pickled (tensor
  subclasses) is read with ``torch.load(weights_only=True)`` and never with a
  fallback; custom and opaque objects, legacy pickled weight files, and
  anything that is not a tensor are refused with an ArchiveError naming the
  part;
* ``data/sample_inputs`` is never read: running a program does not need it
  (the loaded program's ``example_inputs`` is None).

Every entry is read through :class:`~torch_opaque.archive.zipio.ZipReader`
within its size limit (Note [Size limits]).

Example::

    >>> from torch_opaque.archive.program import check_model_json
    >>> check_model_json({"graph_module": {"graph": {"inputs": [], "outputs": [], "nodes": [
    ...     {"target": "torch.os.system", "inputs": [], "outputs": [], "metadata": {}}],
    ...     "tensor_values": {}, "sym_int_values": {}, "sym_bool_values": {}}}}, "m.json", "f.pt2", {})
    Traceback (most recent call last):
    ...
    torch_opaque.errors.ArchiveError: torch_opaque.load: m.json in f.pt2 is not a program torch_opaque loads: program.graph_module.graph.nodes[0].target: 'torch.os.system' is not an operator a loaded program may call (only torch.ops.<namespace>.<op>.<overload> and symbolic-size arithmetic may be called). The archive was crafted or corrupted; it is not loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import pickle
import re
import threading

import functools

import torch

from ..errors import ArchiveError
from .graph_grammar import check_program_json
from .hop_forms import read_empty_results
from .op_policy import check_stored_graph, sym_targets
from .versions import check_archive_version
from .weight_match import weights_mismatch
from .zipio import ArchiveLimits, ZipReader

MODELS_DIR = "models/"
WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
EXTRA_DIR = "extra/"
_PAYLOAD_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")


def _serde():
    """torch's export serialization (imported on first use: it imports Dynamo,
    which ``import torch_opaque`` must not)."""
    from torch._export.serde import schema, serialize

    return schema, serialize


# ---- the model JSON ------------------------------------------------------------------------


def registered_op(t: str) -> bool:
    """Whether a serialized target 'torch.ops.ns.name.overload' names an
    operator this process has registered (not one a file defined)."""
    from ..ops import schema_or_none

    parts = t.split(".")
    return len(parts) == 5 and schema_or_none(parts[2], parts[3], parts[4]) is not None


def check_model_json(model, where: str, description: str, rename: dict, limits=None, described=()):
    """Reads a model JSON against the closed grammar (Note [The graph grammar]
    in graph_grammar.py); returns what it found (``.targets``, ``.nodes``) and
    the schema object built from the checked parts (``.program``). Operators
    outside torch's own namespaces may be called when this process registered
    them, the manifest describes them (`described`) or `rename` maps them to a
    stored overload."""
    described = set(described)

    def custom_ok(t: str) -> bool:
        return t in rename or t in described or registered_op(t)

    with gc_paused():
        return check_program_json(model, where, description, limits or ArchiveLimits(), rename, custom_ok)


@contextlib.contextmanager
def gc_paused():
    """No cyclic GC while a program is read (Note [Linear reading])."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_json(raw: str, where: str, description: str):
    """A JSON entry (a graph, a payload config) within the bounds of
    :func:`~torch_opaque.archive.zipio.loads_json`; ArchiveError naming it."""
    from .zipio import loads_json

    try:
        return loads_json(raw)
    except (ValueError, RecursionError) as e:
        why = "it is nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ArchiveError(
            f"torch_opaque: the JSON entry '{where}' in {description} is corrupted or crafted "
            f"({type(e).__name__}: {why})."
        ) from e


def check_graph(ep, where: str, description: str) -> None:
    """Every call of the deserialized program is an operator (see the Note)."""
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op in ("call_module", "call_method"):
                bad = node.target
            elif node.op == "call_function" and not (
                isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
                or node.target in sym_targets().values()
            ):
                bad = node.target
            else:
                continue
            raise ArchiveError(
                f"torch_opaque.load: {where} in {description} calls {bad!r}, which is not a "
                f"registered operator (node '{node.name}'). Load the library that defines it "
                f"first; a crafted archive is not loaded."
            )


# ---- tensors -----------------------------------------------------------------------------


def _check_payload_name(name, where: str, description: str) -> str:
    if not isinstance(name, str) or not _PAYLOAD_NAME_RE.match(name) or name in (".", ".."):
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} names the payload {name!r}, "
            f"which is not a file name; the archive was crafted or corrupted."
        )
    return name


def _unpickle_tensor(z: ZipReader, entry: str, what: str, description: str) -> torch.Tensor:
    """A tensor torch pickled (a tensor subclass), read with weights_only=True
    only; an inner zip is checked within the limits first.

    weights_only does not check sparse tensors (an index past the size loads,
    and its first use writes out of bounds): they are checked while loading
    (``check_sparse_tensor_invariants``) and again after, with the layouts,
    devices and storage bounds of everything loaded; layouts that cannot be
    checked (quantized, mkldnn, nested, meta) are refused."""
    raw = z.read(entry, "tensors")
    if raw[:2] == b"PK":
        with ZipReader(io.BytesIO(raw), f"{entry} in {description}", z.limits) as inner:
            for n in inner.names:
                inner.check(n, "tensors")
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            t = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ArchiveError(
            f"torch_opaque.load: {what} ('{entry}') in {description} is a pickle that "
            f"torch.load(weights_only=True) refuses, or holds a tensor that fails torch's "
            f"checks ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"torch_opaque never unpickles arbitrary objects, so the archive is not loaded."
        ) from e
    if not isinstance(t, torch.Tensor):
        raise ArchiveError(
            f"torch_opaque.load: {what} ('{entry}') in {description} holds a "
            f"{type(t).__name__}, not a tensor."
        )

    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    sparse = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)

    def refuse(why: str) -> ArchiveError:
        return ArchiveError(
            f"torch_opaque.load: {what} ('{entry}') in {description} is a pickled tensor that "
            f"{why}; the archive was crafted or corrupted, or holds a tensor torch_opaque "
            f"cannot check, and is not loaded."
        )

    def check(x: torch.Tensor, depth: int) -> None:
        if depth > 8:
            raise refuse("nests tensor subclasses more than 8 deep")
        kind = next(
            (k for k, bad in (("quantized", x.is_quantized), ("mkldnn", x.is_mkldnn), ("nested", x.is_nested),
                              ("meta", x.is_meta)) if bad),
            None,
        )  # fmt: skip
        if kind is not None:
            raise refuse(f"is a {kind} tensor (torch_opaque loads strided and sparse tensors only)")
        if x.device.type != "cpu":
            raise refuse(f"loaded on {x.device}, not on the CPU")
        if is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            for n in names:
                inner = getattr(x, n)
                if not isinstance(inner, torch.Tensor):
                    raise refuse(f"has an inner {type(inner).__name__} {n!r}, not a tensor")
                check(inner, depth + 1)
            return
        if x.layout == torch.strided:
            size, stride, offset = tuple(x.size()), tuple(x.stride()), x.storage_offset()
            if any(n < 0 for n in size) or any(st < 0 for st in stride) or offset < 0:
                raise refuse(f"has sizes {size}, strides {stride}, storage offset {offset}")
            need = 0 if 0 in size else offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))
            if need * x.element_size() > x.untyped_storage().nbytes():
                raise refuse(
                    f"needs {need * x.element_size()} bytes of storage (sizes {size}, strides "
                    f"{stride}, offset {offset}) but has {x.untyped_storage().nbytes()}"
                )
            return
        if x.layout not in sparse:
            raise refuse(f"has the layout {x.layout}")
        try:
            if x.layout == torch.sparse_coo:
                torch._validate_sparse_coo_tensor_args(
                    x._indices(), x._values(), x.size(), x.is_coalesced(), check_pinning=False
                )
                parts = (x._indices(), x._values())
            else:
                if x.layout in (torch.sparse_csr, torch.sparse_bsr):
                    compressed, plain = x.crow_indices(), x.col_indices()
                else:
                    compressed, plain = x.ccol_indices(), x.row_indices()
                torch._validate_sparse_compressed_tensor_args(
                    compressed, plain, x.values(), x.size(), x.layout, check_pinning=False
                )
                parts = (compressed, plain, x.values())
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise refuse(f"is an invalid {x.layout} tensor ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        for p in parts:
            check(p, depth + 1)

    try:
        check(t, 0)
    except ArchiveError:
        raise
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as e:
        raise refuse(f"cannot be checked ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    return t


def _payloads(z: ZipReader, root: str, kind_dir: str, config_name: str, model: str, description: str) -> dict:
    """FQN -> tensor for the weights or constants of one model."""
    what = "weight" if kind_dir == WEIGHTS_DIR else "constant"
    legacy = f"{root}{kind_dir}{model}.pt"
    if legacy in z.infos:
        raise ArchiveError(
            f"torch_opaque.load: the {what}s of {description} are stored in the legacy pickled "
            f"format ('{legacy}'), which torch_opaque does not unpickle; save the program again "
            f"with a current torch.export.save / torch_opaque.save."
        )
    config_entry = f"{root}{kind_dir}{config_name.format(model)}"
    if config_entry not in z.infos:
        return {}
    serde_schema, serialize = _serde()
    try:
        config = serialize._dict_to_dataclass(
            serde_schema.PayloadConfig, parse_json(z.text(config_entry, "model"), config_entry, description)
        )
        items = list(config.config.items())
    except ArchiveError:
        raise
    except Exception as e:
        raise ArchiveError(
            f"torch_opaque.load: '{config_entry}' in {description} is invalid "
            f"({type(e).__name__}: {e}); the archive is corrupted."
        ) from e
    # Note [Raw tensor payloads]: what torch.export.save writes for a tensor that
    # is not pickled is the bytes of its whole untyped storage (shared by the
    # views of one storage) and the view's sizes, strides and offset; an empty
    # entry for a tensor without elements or a meta tensor (and for a fake
    # tensor, whose values were never saved). Everything is checked with Python
    # ints before anything is allocated: dtypes from the table below, sizes,
    # strides and offset ints in [0, 2**63), rank <= 64, the declared size
    # within ArchiveLimits.tensors, and the storage the view needs within the
    # entry's bytes.
    st = serde_schema.ScalarType
    dtypes = {
        int(getattr(st, name)): getattr(torch, dt)
        for name, dt in (
            ("BYTE", "uint8"), ("CHAR", "int8"), ("SHORT", "int16"), ("INT", "int32"), ("LONG", "int64"),
            ("HALF", "float16"), ("FLOAT", "float32"), ("DOUBLE", "float64"), ("COMPLEXHALF", "complex32"),
            ("COMPLEXFLOAT", "complex64"), ("COMPLEXDOUBLE", "complex128"), ("BOOL", "bool"),
            ("BFLOAT16", "bfloat16"), ("UINT16", "uint16"), ("UINT32", "uint32"), ("UINT64", "uint64"),
            ("FLOAT8E4M3FN", "float8_e4m3fn"), ("FLOAT8E5M2", "float8_e5m2"),
            ("FLOAT8E4M3FNUZ", "float8_e4m3fnuz"), ("FLOAT8E5M2FNUZ", "float8_e5m2fnuz"),
            ("FLOAT8E8M0FNU", "float8_e8m0fnu"),
        )
        if hasattr(st, name) and isinstance(getattr(torch, dt, None), torch.dtype)
    }  # fmt: skip
    devices = ("cpu", "cuda", "meta", "xpu", "mps", "hpu", "mtia", "privateuseone")
    int64 = 1 << 63

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def bounded(sym, what: str) -> int:
        if not isinstance(sym, serde_schema.SymInt) or sym.type != "as_int":
            raise ValueError(f"its {what} is not a plain integer (got {sym!r:.80})")
        v = sym.value
        if not is_int(v) or not 0 <= v < int64:
            raise ValueError(f"its {what} {v!r:.40} is not an integer in [0, 2**63)")
        return v

    def flag(v, what: str) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"its {what} {v!r:.40} is not true or false")
        return v

    storages: dict = {}  # path -> [dtype, bytes in the entry, flat tensor once read]
    out: dict = {}
    for fqn, meta in items:
        part = f"{what} '{fqn}'"
        if not isinstance(meta, serde_schema.PayloadMeta):
            raise ArchiveError(
                f"torch_opaque.load: {part} in {description} has no payload record; the "
                f"archive is corrupted."
            )
        path = _check_payload_name(meta.path_name, part, description)
        entry = f"{root}{kind_dir}{path}"
        try:
            if kind_dir == CONSTANTS_DIR and not path.startswith("tensor_"):
                raise ArchiveError(
                    f"torch_opaque.load: {part} ('{entry}') in {description} is a custom or "
                    f"opaque object, which only unpickling (running code from the file) could "
                    f"restore; torch_opaque refuses it. Programs with script objects cannot "
                    f"be loaded with torch_opaque.load."
                )
            if flag(meta.use_pickle, "use_pickle"):
                out[fqn] = _unpickle_tensor(z, entry, part, description)
                continue
            tm = meta.tensor_meta
            if not isinstance(tm, serde_schema.TensorMeta):
                raise ValueError("it has no tensor metadata")
            dtype = dtypes.get(tm.dtype) if is_int(tm.dtype) else None
            if dtype is None:
                raise ValueError(f"its dtype {tm.dtype!r:.40} is not one torch writes raw")
            if not is_int(tm.layout) or tm.layout != int(serde_schema.Layout.Strided):
                raise ValueError(
                    f"its layout {tm.layout!r:.40} is not strided (torch pickles tensors of "
                    f"other layouts)"
                )
            if not isinstance(tm.sizes, list) or not isinstance(tm.strides, list):
                raise ValueError("its sizes and strides are not lists")
            if len(tm.sizes) > 64 or len(tm.strides) != len(tm.sizes):
                raise ValueError(f"it has {len(tm.sizes)} sizes and {len(tm.strides)} strides (at most 64 dimensions)")
            size = tuple(bounded(v, f"size {i}") for i, v in enumerate(tm.sizes))
            stride = tuple(bounded(v, f"stride {i}") for i, v in enumerate(tm.strides))
            offset = bounded(tm.storage_offset, "storage offset")
            dev = tm.device
            if (
                not isinstance(dev, serde_schema.Device)
                or not isinstance(dev.type, str)
                or dev.type not in devices
                or not (dev.index is None or (is_int(dev.index) and 0 <= dev.index < 1 << 16))
            ):
                raise ValueError(f"its device {dev!r:.80} is not a device torch writes")
            device = serialize.deserialize_device(dev)
            requires_grad = flag(tm.requires_grad, "requires_grad")
            is_param = flag(meta.is_param, "is_param")
            elem = torch._utils._element_size(dtype)
            if path not in storages:  # the entry within the limits first
                nbytes = z.check(entry, "tensors")
                if nbytes % elem:
                    raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
                storages[path] = [dtype, nbytes, None]
            numel = functools.reduce(lambda a, b: a * b, size, 1)
            if functools.reduce(lambda a, b: a * b, (n for n in size if n), 1) >= int64:
                raise ValueError(f"its sizes {size} have more than 2**63 elements")
            if numel * elem > z.limits.tensors:
                raise ArchiveError(
                    f"torch_opaque.load: {part} ('{entry}') in {description} declares "
                    f"{numel * elem} bytes (sizes {size}, {dtype}), more than the tensors limit "
                    f"of {z.limits.tensors} bytes. Raise it with limits=ArchiveLimits(tensors=...) "
                    f"if you trust the file."
                )
            # elements of the storage the view reaches
            need = 0 if numel == 0 else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
            store = storages[path]
            if store[0] != dtype:
                raise ValueError(f"it is {dtype} but shares its entry with a {store[0]} tensor")
            nbytes = store[1]
            if device.type == "meta":
                base = torch.empty(need, dtype=dtype, device="meta")  # no data, nothing read
            elif need * elem > nbytes:
                if nbytes == 0:
                    raise ArchiveError(
                        f"torch_opaque.load: {part} ('{entry}') in {description} has sizes "
                        f"{size} ({numel} elements) but its entry holds no bytes. torch writes "
                        f"an empty entry for a tensor with elements only when the program was "
                        f"exported with fake weights, whose values were never saved; "
                        f"torch_opaque does not make them up. The archive is not loaded."
                    )
                raise ArchiveError(
                    f"torch_opaque.load: {part} ('{entry}') in {description} has sizes {size}, "
                    f"strides {stride} and storage offset {offset}, which reach {need * elem} "
                    f"bytes of storage, but its entry holds {nbytes}; the archive was crafted "
                    f"or corrupted."
                )
            else:
                if store[2] is None:
                    if nbytes == 0:
                        store[2] = torch.empty(0, dtype=dtype)
                    else:
                        store[2] = torch.frombuffer(bytearray(z.read(entry, "tensors")), dtype=dtype)
                base = store[2]
            t = torch.as_strided(base, size, stride, offset)
            if device != torch.device("cpu") and device.type != "meta":
                t = t.to(device)
            if kind_dir == WEIGHTS_DIR and is_param:
                t = torch.nn.Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            out[fqn] = t
        except ArchiveError:
            raise
        except Exception as e:
            raise ArchiveError(
                f"torch_opaque.load: {part} ('{entry}') in {description} cannot be rebuilt "
                f"({type(e).__name__}: {e}); the archive is corrupted."
            ) from e
    return out


# ---- programs ----------------------------------------------------------------------------


def archive_root(z: ZipReader) -> str:
    """The folder every entry of a pt2 archive lives in ('name/')."""
    roots = {n.split("/", 1)[0] for n in z.names}
    if len(roots) != 1 or any("/" not in n for n in z.names):
        raise ArchiveError(
            f"torch_opaque: {z.description} is not a .pt2 archive (its entries are not in one "
            f"folder, as torch.export.save writes them)."
        )
    return next(iter(roots)) + "/"


def model_names(z: ZipReader, root: str) -> list:
    out = []
    for n in z.names:
        rest = n[len(root) :]
        if rest.startswith(MODELS_DIR) and rest.endswith(".json") and "/" not in rest[len(MODELS_DIR) :]:
            out.append(rest[len(MODELS_DIR) : -len(".json")])
    return sorted(out)


def read_model_json(z: ZipReader, root: str, model: str, description: str):
    entry = f"{root}{MODELS_DIR}{model}.json"
    return parse_json(z.text(entry, "model"), entry, description)


def read_tensors(z: ZipReader, root: str, model: str, description: str) -> tuple:
    """(state_dict, constants) of one model, rebuilt from raw bytes (see the Note)."""
    from torch.export.pt2_archive.constants import (
        CONSTANTS_CONFIG_FILENAME_FORMAT,
        WEIGHTS_CONFIG_FILENAME_FORMAT,
    )

    wname = WEIGHTS_CONFIG_FILENAME_FORMAT[len(WEIGHTS_DIR) :]
    cname = CONSTANTS_CONFIG_FILENAME_FORMAT[len(CONSTANTS_DIR) :]
    return (
        _payloads(z, root, WEIGHTS_DIR, wname, model, description),
        _payloads(z, root, CONSTANTS_DIR, cname, model, description),
    )


# Note [One deserializer at a time]: torch's ExportedProgramDeserializer keeps
# the program it is reading in a module global (_CURRENT_DESERIALIZER) and
# refuses to start while another thread's is set, so two threads loading at
# once failed. Every deserialization (programs and the stored programs they
# call) holds this lock; re-entrant, as a stored program is read while the
# loading thread holds nothing else of torch's.
_DESERIALIZER_LOCK = threading.RLock()


def deserialize(model_json, tensors: tuple, description: str, where: str, rename: dict, limits=None, stored=False):
    """An ExportedProgram from a model's JSON (checked, and renamed in place)
    and its (state_dict, constants); no sample inputs. `stored`: a program
    stored in a self-contained archive (checked for writes by its caller)."""
    state_dict, constants = tensors
    _, serialize = _serde()
    # Note [Linear reading]: the cyclic GC, run again and again while the schema
    # objects and the FX graph are built, makes a program's cost grow with the
    # square of its nodes; nothing built here is garbage until it is done.
    try:
        with gc_paused():
            serialized = check_model_json(model_json, where, description, rename, limits).program
            read_empty_results(serialized)  # Note [Higher-order ops in archives]
            with _DESERIALIZER_LOCK:  # Note [One deserializer at a time]
                ep = serialize.ExportedProgramDeserializer(None).deserialize(
                    serialized, state_dict, constants, None
                )
    except ArchiveError:
        raise
    except Exception as e:
        raise ArchiveError(
            f"torch_opaque.load: cannot load the exported program {where} in {description}: "
            f"{type(e).__name__}: {e}"
        ) from e
    check_graph(ep, where, description)
    check_what_runs(ep, f"{where} in {description}", writes=not stored)
    return ep


def check_what_runs(ep, where: str, writes: bool = True) -> None:
    """What the program does when it runs: its weights are what its placeholders
    say, its batch-norm calls index within their arguments, and it writes only
    what its signature declares (Note [Weights match their placeholders],
    Note [Operators a loaded program may call], Note [Writes a loaded program
    may make])."""
    from .op_policy import check_batch_norm
    from .writes import undeclared_write

    why = weights_mismatch(ep, where) or check_batch_norm(ep.graph_module, where)
    if why is None and writes:
        why = undeclared_write(ep, where)
    if why is not None:
        raise ArchiveError(f"torch_opaque.load: {why}. The archive was crafted or corrupted; it is not loaded.")


def program_from_bytes(data: bytes, description: str, where: str, limits, rename: dict):
    """A program stored inside a self-contained archive (a whole pt2 archive in
    bytes), read the same way: no sample inputs, no pickles."""
    # a stored program's own graph is bounded by the limit of stored programs
    inner = dataclasses.replace(limits, model=min(limits.model, limits.program), metadata=limits.program * 4)
    with ZipReader(io.BytesIO(data), f"{where} in {description}", inner) as z:
        root = archive_root(z)
        check_archive_version(z, root)
        names = model_names(z, root)
        if names != ["model"]:
            raise ArchiveError(
                f"torch_opaque.load: {where} in {description} holds models {names}, not one "
                f"'model'; the archive is corrupted."
            )
        model_json = read_model_json(z, root, "model", z.description)
        check_model_json(model_json, where, description, rename, inner)
        tensors = read_tensors(z, root, "model", description)
    ep = deserialize(model_json, tensors, description, where, rename, inner, stored=True)
    why = check_stored_graph(ep.graph_module, f"{where} in {description}")
    sig = ep.graph_signature
    if why is None and (sig.user_inputs_to_mutate or sig.buffers_to_mutate or sig.parameters_to_mutate):
        why = (
            f"{where} in {description} declares that it mutates its inputs (its signature's "
            f"output specs), which the op's schema declares functional"
        )
    if why is not None:
        raise ArchiveError(f"torch_opaque.load: {why}. The archive was crafted; it is not loaded.")
    return ep


def module_of(ep, where: str, description: str):
    """``ep.module()``, its failures an ArchiveError (a program whose JSON passed
    the grammar may still be inconsistent, e.g. in its module call graph)."""
    try:
        with gc_paused():
            return ep.module()
    except Exception as e:
        raise ArchiveError(
            f"torch_opaque.load: {where} in {description} cannot be made a module "
            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); the archive is corrupted."
        ) from e



