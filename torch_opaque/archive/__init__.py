"""Exported programs that travel: ``torch_opaque.save`` / ``torch_opaque.load``.

A program exported with opaque ops names them (``torch.ops.opaque.Foo.Tensor``)
but does not contain them: ``torch.export.load`` in another process fails
unless something registered them first. ``torch_opaque.save`` writes a plain
``torch.export.save`` archive plus a JSON manifest (an ``extra_files`` entry)
that says, for each opaque op in the program, its overloads and schemas and
the module and class of the autograd.Function that defines it.
``torch_opaque.load`` reads the manifest first and re-registers missing ops:

* an op already registered in this process is reused (its schema must match);
* otherwise the defining module is imported, but only when the caller allows
  it: ``load(path, allow=["mymodule"])`` (module names or dotted prefixes) or
  ``allow_all=True``. Nothing is imported by default; a missing op whose
  module is not allowed is an :class:`OpNotAllowedError` that names the op,
  the module and the ``allow=`` to pass, raised before anything is imported;
* an archive saved with ``self_contained=True`` also stores, for each op, its
  forward and backward traced to ATen (see Note [Self-contained archives]); an
  op whose module is not allowed (or absent) is then re-created from them.

Loading and ``python -m torch_opaque inspect`` run nothing from the file: the
archive is read as data within size limits (Note [Size limits] in zipio.py),
without unpickling or evaluating any part of it (Note [Reading pt2 without
unpickling] in program.py): every part is read against a closed grammar of our
own (Note [The graph grammar] in graph_grammar.py, sym_expr.py for symbolic
sizes, manifest.py) and may call only the operators of Note [Operators a loaded
program may call] (op_policy.py); the only code that may run is that of the
modules the caller allows. An archive never changes a Function the process owns
(Note [Archive claims] in _impl/opaque_function.py, Note [The caller's own ops] in
own_ops.py), and a Function whose definition changed since saving is refused
or run as ``load(function_changed=)`` says (Note [Function fingerprints] in
fingerprint.py); the stored programs' call graph is acyclic and bounded (Note
[Stored call graph] in call_graph.py). docs/shipping.md's trust model lists
what loading and running guarantee, with the limits.

Files: manifest.py (the typed manifest and its one reader), zipio.py (bounded
zip reading), graph_grammar.py / sym_expr.py / op_policy.py / admitted_ops.py
(the grammar of the graph, of symbolic sizes, and the operators a loaded
program may call, by family), versions.py (the pt2 format and version),
program.py (pt2 programs read without unpickling), weight_match.py (weights
against their placeholders), reader.py (what an archive
holds, for load and inspect), values.py (stored argument values), saving.py /
trace.py (writing; tracing calls to ATen), hop_forms.py / optional_outputs.py
(what torch's serializer cannot write by itself: higher-order ops, ``Tensor?[]``
results), readback.py (save reads back what it wrote), loading.py / stored.py
(loading; ops re-created from stored programs), call_graph.py / fingerprint.py /
own_ops.py (what loading checks of stored calls, Function identity and the
process's own Functions).

Example::

    >>> import torch, torch_opaque, tempfile, os
    >>> @torch_opaque.op(name="DocArchSin")
    ... class DocSin(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x.sin()
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return g * x.cos()
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return DocSin.apply(x)
    >>> ep = torch.export.export(M(), (torch.randn(3),))
    >>> path = os.path.join(tempfile.mkdtemp(), "m.pt2")
    >>> torch_opaque.save(ep, path)
    >>> torch_opaque.load(path).module()(torch.zeros(3))   # the op exists here
    tensor([0., 0., 0.])

Note [Self-contained archives]
For every opaque op of the program, each distinct kind of call (overload,
values of the non-tensor arguments, dtypes, which dimensions are static) is
traced once with ``torch.export.export`` (non-strict) from concrete example
inputs whose sizes are the hints of the program's (possibly symbolic) sizes.
A dimension that is symbolic in the program is marked ``Dim.AUTO``, so the
stored programs stay dynamic where the program is (and specialise only where
the Function's code requires it); static dimensions stay static. Two programs
are stored per kind of call, as ``torch.export.save`` bytes (base64) in
``extra_files`` (read back without unpickling, Note [Reading pt2 without
unpickling] in program.py):

* forward: (tensor arguments, symbolic int arguments) -> (outputs, residuals,
  symbolic ints the forward left on ctx); the rest of the forward record (which
  tensors are saved, non-differentiable outputs) is static and kept in the
  manifest;
* backward: (saved tensors, output gradients, those ints) -> gradients,
  traced with every tensor input needing a gradient (unneeded ones are
  dropped at run time).

The forward and backward are the Function's (run through the same C++ code as
the real kernels), or, for an op defined in C++ (``TORCH_OPAQUE_DEF``), its own
``_fwd`` / ``_bwd`` kernels run below autograd, so that their ATen calls are
traced (Note [Kernels below autograd] in csrc/python/kernel_below_autograd.h).
A C++ kernel that is not made of ATen ops (a loop over ``data_ptr``) cannot be
traced: saving fails naming the op and the way out (an allow-list archive and
``torch_opaque.load_library`` before loading). C++ ops with ``Tensor[]``
arguments or results are not stored self-contained (their per-element
gradients differ from a Python Function's).

Loading defines the op (as its own overload, Note [Stored ops beside real
ones] in stored.py) with ``_C.define_op`` whose kernels run these programs,
plus fake kernels (the same programs on fake tensors), so the loaded program
runs, re-exports and trains through the stored backward. A call that none of
the stored programs covers (other non-tensor values, dtypes, or other sizes
in a static dimension) fails with an error saying so.
"""

from ..errors import ArchiveError, OpNotAllowedError
from .loading import load
from .saving import save
from .zipio import ArchiveLimits

__all__ = ["save", "load", "ArchiveError", "OpNotAllowedError", "ArchiveLimits"]
