"""Fingerprints of autograd.Functions: which definition an archive was saved
with (Note [Function fingerprints]).

Note [Function fingerprints]
An archive names each op's Function by module and class. Loaded where that
module now defines a different forward (same name and schema), the program
would silently run the new math. So ``torch_opaque.save`` records, for each
Python Function, a fingerprint of its definition, and ``torch_opaque.load``
compares it with the Function the process would run (one it already has, or
one an allowed module defines), before anything is defined:

* what is hashed: for each of ``forward``, ``setup_context``, ``backward``,
  ``vjp``, ``jvp`` and ``fake`` that the class (or a base other than
  autograd.Function) defines, its source text with comments and blank space
  removed (so the same code in another file, directory or indentation gives
  the same fingerprint, in any process and any Python version), its default
  arguments, the values its closure holds, and the module-level values its code
  names that are plain constants or functions of the same module (hashed the
  same way, recursively, each once). Values are hashed by type and content
  (numbers, strings, tuples, dtypes, tensors by dtype, shape and bytes);
  other objects by their type's qualified name. A function without source
  (defined by ``exec``) is hashed by its bytecode, which is stable across
  processes of one Python version.
* what a mismatch does is the caller's choice, ``load(...,
  function_changed=)``: ``"error"`` (the default) refuses the archive with an
  ArchiveError naming the op, the class and the other choices;
  ``"run_process"`` runs the process's definition (with a warning saying so);
  ``"run_stored"`` runs the programs a self-contained archive stored for that
  op (the definition it was saved with), an error when it stored none.
* archives written before fingerprints were recorded carry none: nothing is
  compared (docs/limits.md).

Example::

    >>> import torch
    >>> from torch_opaque.archive.fingerprint import function_fingerprint
    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 2   # a comment is not part of the code
    >>> len(function_fingerprint(Twice))
    32
"""

from __future__ import annotations

import hashlib
import inspect
import io
import textwrap
import tokenize
import types

import torch

FUNCTION_CHANGED = ("error", "run_process", "run_stored")
_METHODS = ("forward", "setup_context", "backward", "vjp", "jvp", "fake")
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_MAX_TENSOR_BYTES = 1 << 20  # larger closed-over tensors are hashed by their metadata


def function_fingerprint(cls) -> str:
    """32 hex digits naming the definition of the autograd.Function ``cls``."""
    h = _Hasher()
    for attr in _METHODS:
        f = _own_attr(cls, attr)
        h.feed("method", attr)
        if f is not None:
            h.value(f)
    return h.digest()


def _own_attr(cls, attr: str):
    """The attribute as the class (or a base below autograd.Function) defines it."""
    stock = set(torch.autograd.Function.__mro__)
    for base in cls.__mro__:
        if base in stock:
            return None
        if attr in base.__dict__:
            f = base.__dict__[attr]
            return f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
    return None


def normalized_source(f) -> str:
    """The source text of ``f`` without comments, blank lines or indentation
    differences; OSError/TypeError where there is none."""
    text = textwrap.dedent(inspect.getsource(f))
    out, last_line = [], 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NEWLINE:
            out.append("\n")
            continue
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            out.append(f"<{tokenize.tok_name[tok.type]}>")
            continue
        if tok.start[0] != last_line and out and out[-1] != "\n":
            out.append(" ")  # a line continued
        last_line = tok.end[0]
        out.append(tok.string)
        out.append(" ")
    return "".join(out)


class _Hasher:
    def __init__(self):
        self.h = hashlib.sha256()
        self.seen: dict = {}  # id -> index of functions already hashed (recursion, sharing)

    def digest(self) -> str:
        return self.h.hexdigest()[:32]

    def feed(self, kind: str, text) -> None:
        data = text if isinstance(text, bytes) else str(text).encode("utf-8", "surrogatepass")
        self.h.update(f"{kind}:{len(data)}:".encode())
        self.h.update(data)

    def value(self, v, depth: int = 0) -> None:
        if depth > 16:
            self.feed("deep", type(v).__qualname__)
        elif isinstance(v, _PLAIN):
            self.feed(type(v).__name__, repr(v))
        elif isinstance(v, (tuple, list, frozenset, set)):
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            self.feed(type(v).__name__, len(items))
            for item in items:
                self.value(item, depth + 1)
        elif isinstance(v, dict):
            self.feed("dict", len(v))
            for k in sorted(v, key=repr):
                self.value(k, depth + 1)
                self.value(v[k], depth + 1)
        elif isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            self.feed("torch", str(v))
        elif isinstance(v, torch.Tensor):
            self.tensor(v)
        elif isinstance(v, (staticmethod, classmethod)):
            self.value(v.__func__, depth + 1)
        elif isinstance(v, types.FunctionType):
            self.function(v, depth)
        elif isinstance(v, type):
            self.feed("class", f"{v.__module__}.{v.__qualname__}")
        elif isinstance(v, types.ModuleType):
            self.feed("module", v.__name__)
        elif isinstance(v, types.BuiltinFunctionType):
            self.feed("builtin", f"{getattr(v, '__module__', '')}.{v.__qualname__}")
        else:
            self.feed("object", f"{type(v).__module__}.{type(v).__qualname__}")

    def tensor(self, t: torch.Tensor) -> None:
        self.feed("tensor", f"{t.dtype}{tuple(t.shape)}{t.layout}{t.device.type}")
        if t.layout == torch.strided and t.device.type == "cpu" and not t.is_meta:
            try:
                c = t.detach().contiguous()
                if c.numel() * c.element_size() <= _MAX_TENSOR_BYTES:
                    self.feed("data", bytes(c.view(torch.uint8).reshape(-1).tolist()) if c.dim() else repr(c.item()))
            except (RuntimeError, TypeError):
                pass

    def function(self, f: types.FunctionType, depth: int) -> None:
        if id(f) in self.seen:
            self.feed("again", self.seen[id(f)])
            return
        self.seen[id(f)] = len(self.seen)
        try:
            self.feed("source", normalized_source(f))
        except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
            self.code(f.__code__)
        self.value(f.__defaults__, depth + 1)
        self.value(f.__kwdefaults__, depth + 1)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            self.feed("free", name)
            try:
                self.value(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                self.feed("empty", name)
        g = f.__globals__
        module = f.__module__
        for name in sorted(_names(f.__code__)):
            v = g.get(name, _MISSING)
            if v is _MISSING:
                continue
            if isinstance(v, _PLAIN) or (isinstance(v, types.FunctionType) and v.__module__ == module):
                self.feed("global", name)
                self.value(v, depth + 1)

    def code(self, co: types.CodeType) -> None:
        self.feed("code", co.co_code)
        self.feed("names", " ".join(co.co_names))
        self.feed("vars", " ".join(co.co_varnames))
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c)
            else:
                self.value(c, 1)


_MISSING = object()


def _names(co: types.CodeType) -> set:
    """The global names a code object (and its nested code) may read."""
    out = set(co.co_names)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def definition_to_run(op, cls, description: str, function_changed: str, stored: bool) -> str:
    """Note [Function fingerprints]: "process" when the process's Function
    ``cls`` may define ``op`` (the same definition, no fingerprint recorded, or
    ``function_changed="run_process"``, with a warning), "stored" when the
    archive's stored programs run instead; ArchiveError otherwise. ``stored``:
    whether the archive stored programs for every overload of ``op``."""
    import warnings

    from ..errors import ArchiveError

    if op.fingerprint is None:
        return "process"
    current = function_fingerprint(cls)
    if current == op.fingerprint:
        return "process"
    who = f"{cls.__module__}.{cls.__qualname__}"
    what = (
        f"{description} was saved with another definition of {who}, the Function of "
        f"{op.qualified_name}: its forward/backward code (or what they close over) changed since "
        f"(fingerprint {op.fingerprint} in the archive, {current} in this process)"
    )
    if function_changed == "run_process":
        warnings.warn(
            f"torch_opaque.load: {what}; {op.qualified_name} runs this process's definition, "
            f"as function_changed='run_process' asks.",
            stacklevel=4,
        )
        return "process"
    if function_changed == "run_stored":
        if stored:
            return "stored"
        raise ArchiveError(
            f"torch_opaque.load: {what}. function_changed='run_stored' runs the programs a "
            f"self-contained archive stored, but this archive stores none for "
            f"{op.qualified_name}: pass function_changed='run_process' to run this process's "
            f"definition, or save the program again with self_contained=True."
        )
    raise ArchiveError(
        f"torch_opaque.load: {what}, so the program would not compute what it was saved "
        f"computing. Choose what runs: torch_opaque.load(..., function_changed='run_process') "
        f"runs this process's definition, function_changed='run_stored' the programs the "
        f"archive stored (self-contained archives), or export and save the program again."
    )
