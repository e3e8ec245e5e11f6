"""Fake kernels for ops defined in C++ (``TORCH_OPAQUE_DEF``) that have no
``fake`` of their own.

Note [C++ kernels as fakes]
A C++ op's CompositeExplicitAutograd kernel also serves the Meta key, so it
runs on fake tensors. But FakeTensorMode runs a Meta kernel with Python
dispatch switched off: the ATen calls inside the kernel then reach ATen's own
C++ kernels, which need concrete sizes, and any broadcast, ``expand`` or view
on a symbolic size fails ("SymIntArrayRef expected to contain only concrete
integers"): a dynamic-batch export of ``x.mm(w.t()) + bias`` could not be
traced. ``torch_opaque.load_library`` therefore registers, for each op it
loads, a fake that calls the same kernel while the fake mode stays active, so
each ATen call inside it is a fake-tensor call with symbolic sizes: for
``Name_bwd`` always (a C++ ``fake`` covers the forward only), for ``Name`` and
``Name_fwd`` when the op has no ``fake`` (then those have a Meta kernel, left
as it is).

Example (``example::scaled_sin`` of examples/cpp, built by scripts/dev.sh)::

    >>> import torch, torch_opaque
    >>> torch_opaque.load_library("build/examples_cpp/libexample_ops.so")  # in a checkout
    >>> from torch_opaque._impl.cpp_fakes import has_kernel_fake
    >>> has_kernel_fake("example::scaled_sin_bwd")
    True
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from .function import function_for_op

_KERNEL_KEY = torch._C.DispatchKey.CompositeExplicitAutograd
_registered: set = set()  # "ns::Name" of ops given a kernel fake
_libraries: dict = {}  # namespace -> torch.library.Library (FRAGMENT), kept alive
_library_digests: dict = {}  # path of a loaded shared library -> sha256 of its file
_TAG_PREFIX = "torch_opaque-cpp-libraries:"


def op_names() -> set:
    """Every operator name the dispatcher knows now (with overload names)."""
    return set(torch._C._dispatch_get_all_op_names())


def has_kernel_fake(name: str) -> bool:
    """Whether ``name`` ("ns::Name", any overload) got a fake from this module."""
    return name in _registered


def _kernel_fake(overload: torch._ops.OpOverload):
    def fake(*args, **kwargs):
        return overload._op_dk(_KERNEL_KEY, *args, **kwargs)

    fake.__name__ = f"kernel_fake_{overload._schema.name.replace('::', '_')}"
    return fake


def _overloads(qualified: str) -> Iterable[torch._ops.OpOverload]:
    ns, _, name = qualified.partition("::")
    packet = getattr(getattr(torch.ops, ns), name)
    return [getattr(packet, o) for o in packet.overloads()]


def register_kernel_fakes(new_names: Iterable[str]) -> None:
    """Give the C++-defined opaque ops among ``new_names`` (dispatcher names,
    "ns::Name" or "ns::Name.overload") fakes that run their kernels under the
    fake mode (Note [C++ kernels as fakes]); then keys Inductor's caches by
    the loaded libraries (Note [Compile caches and C++ libraries])."""
    bases = {n.split(".")[0] for n in new_names}
    for base in sorted(bases):
        if base.endswith(("_fwd", "_bwd")) or not {base + "_fwd", base + "_bwd"} <= bases:
            continue  # not the main name of a triple defined by this load
        ns, _, name = base.partition("::")
        if function_for_op(ns, name) is not None:
            continue  # defined from Python: its fakes are registered with it
        lib = _libraries.get(ns)
        if lib is None:
            lib = _libraries[ns] = torch.library.Library(ns, "FRAGMENT")
        for qualified in (base, base + "_fwd", base + "_bwd"):
            for overload in _overloads(qualified):
                if torch._C._dispatch_has_kernel_for_dispatch_key(overload._name, "Meta"):
                    continue  # the op's own `fake` (forward roles only)
                torch.library.register_fake(overload, _kernel_fake(overload), lib=lib)
                _registered.add(qualified)
    key_compile_caches()


# Note [Compile caches and C++ libraries]
# Inductor's caches (AOTAutogradCache, FxGraphCache) key a compiled graph by
# the Dynamo graph, which names a C++ op but holds nothing of its code. What
# the compiled code does depends on that code: the traced backward keeps the
# gradients the op's `_bwd` gave when traced (an element whose gradient was
# undefined has none). After the library is rebuilt with another backward, a
# warm cache served the old compiled code: x.grad stayed None under inductor,
# silently, while aot_eager (which caches nothing) and eager were right. So
# the digest of every library loaded with torch.ops.load_library goes into
# torch.compiler.config.cache_key_tag, which both caches hash (appended to
# the user's own tag, as one ';'-separated part of its own).
def key_compile_caches() -> None:
    """Fold the contents of the loaded shared libraries into Inductor's cache
    keys (Note [Compile caches and C++ libraries])."""
    for path in sorted(torch.ops.loaded_libraries):
        if path not in _library_digests:
            try:
                with open(path, "rb") as f:
                    _library_digests[path] = hashlib.sha256(f.read()).hexdigest()
            except OSError:  # gone since it was loaded: keyed by its path
                _library_digests[path] = "path:" + path
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return
    digest = hashlib.sha256("".join(sorted(_library_digests.values())).encode()).hexdigest()
    parts = [p for p in config.cache_key_tag.split(";") if p and not p.startswith(_TAG_PREFIX)]
    config.cache_key_tag = ";".join(parts + [_TAG_PREFIX + digest[:32]])
