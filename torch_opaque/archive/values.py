"""Non-tensor argument values as stored in a manifest, and the argument helpers
shared by the save and load sides of self-contained archives.

Tagged values (``{"dtype": "float32"}``) are decoded through explicit tables,
never by looking names up on the ``torch`` module.

Example::

    >>> import torch
    >>> from torch_opaque.archive.values import decode_value, encode_value
    >>> encode_value(torch.float16), decode_value({"dtype": "float16"})
    ({'dtype': 'float16'}, torch.float16)
"""

from __future__ import annotations

import re
from typing import Any

import torch

_DTYPE_NAMES = (
    "float32 float64 float16 bfloat16 complex32 complex64 complex128 uint8 uint16 uint32 "
    "uint64 int8 int16 int32 int64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz "
    "float8_e5m2fnuz qint8 quint8 qint32"
).split()
DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
LAYOUTS = {
    n: getattr(torch, n)
    for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn")
    if isinstance(getattr(torch, n, None), torch.layout)
}
MEMORY_FORMATS = {
    n: getattr(torch, n)
    for n in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
}
_DEVICE_RE = re.compile(r"^(cpu|cuda|meta|mps|xpu|hpu|mtia|privateuseone)(:[0-9]{1,4})?$")
_TABLES = {"dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS}


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def encode_value(v: Any) -> Any:
    """A JSON-able, comparable encoding of a non-tensor argument value."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, torch.SymBool):
        return bool(v)
    if isinstance(v, (int, torch.SymInt)):
        return int(v)
    if isinstance(v, (float, torch.SymFloat)):
        return {"float": repr(float(v))}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).replace("torch.", "")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).replace("torch.", "")}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    raise TypeError(f"cannot store a {type(v).__name__} argument")


def decode_value(v: Any) -> Any:
    """The value an encoding stands for; ValueError for anything not in the tables."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if len(v) != 1:
            raise ValueError(f"a tagged value has one key, got {sorted(v)}")
        ((tag, body),) = v.items()
        if not isinstance(body, str):
            raise ValueError(f"the {tag!r} value must be a string, got {body!r}")
        if tag == "float":
            try:
                return float(body)
            except ValueError:
                raise ValueError(f"{body!r} is not a float") from None
        if tag in _TABLES:
            table = _TABLES[tag]
            if body not in table:
                raise ValueError(f"unknown {tag} {body!r} (known: {', '.join(sorted(table))})")
            return table[body]
        if tag == "device":
            if not _DEVICE_RE.match(body):
                raise ValueError(f"unknown device {body!r}")
            return torch.device(body)
        raise ValueError(f"unknown value tag {tag!r}")
    if v is None or isinstance(v, (bool, int, str)):
        return v
    raise ValueError(f"{v!r} is not a stored value")


def normalize_value(v: Any, arg) -> Any:
    """A value as the kernel of this schema argument receives it."""
    t = arg.type
    if v is None:
        return None
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.FloatType) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        items = list(v)
        if isinstance(e, torch.FloatType):
            return [float(x) if isinstance(x, (int, float)) else x for x in items]
        return items
    return v
