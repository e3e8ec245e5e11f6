"""The contract between the C++ bridge and Python runners.

The real kernels of an opaque op made from Python run in C++
(Note [Python kernels] in csrc/python/python_kernel.h). The bridge reads
attributes from, and calls methods on, one forward runner and one backward
runner per op; two kinds of runner exist: a Function's
(``_impl/kernels.Runner`` / ``BackwardRunner``) and a stored program's
(``archive/stored.py``). What the bridge reads is written down here, once:

* :class:`ForwardRunnerProtocol` and :class:`BackwardRunnerProtocol` name every
  attribute and method csrc/python/python_kernel.cpp uses (no private names);
* :class:`ForwardChecks` and :class:`BackwardChecks` implement the error paths
  the bridge calls, so both kinds of runner raise the same errors;
* :func:`new_dynamic_size` is what a C++ op's fake reaches through
  ``ctx.new_dynamic_size()`` (csrc/python/module.cpp installs the hook);
* :class:`SavedKind` is the C++ enum ``torch_opaque::SavedKind``
  (include/torch_opaque/forward_record.h): where a saved tensor comes from, as
  the forward record's (kind, index, item) triples give it.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, NoReturn, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch._library import fake_impl

from ..errors import SchemaError, UnsupportedError


class SavedKind(enum.IntEnum):
    """``torch_opaque::SavedKind``: the same names (``None`` spelled ``NONE``)
    and the same values."""

    NONE = 0  # ctx.save_for_backward(None)
    INPUT = 1  # argument `index` (a Tensor or Tensor? argument)
    INPUT_LIST_ITEM = 2  # element `item` of argument `index` (a Tensor[] argument)
    OUTPUT = 3  # output `index`
    RESIDUAL = 4  # element `index` of the `_fwd` op's residual list


def saved_triples(flat: Sequence[int]) -> list:
    """The forward record's flat (kind, index, item, kind, ...) integers as
    (SavedKind, index, item) triples."""
    return [
        (SavedKind(flat[k]), int(flat[k + 1]), int(flat[k + 2])) for k in range(0, len(flat), 3)
    ]


@runtime_checkable
class ForwardRunnerProtocol(Protocol):
    """What the C++ forward kernel reads (``forward_spec`` in python_kernel.cpp)."""

    fn_name: str  # for messages
    forward: Callable  # forward(ctx, *args), or forward(*args) with setup_context
    setup_context: Optional[Callable]
    n_out: int
    no_grad: tuple  # needs_input_grad of a call that is not recorded
    convs: Sequence  # non-empty: call convert_args on the kernel's argument values
    # True: eager calls keep ctx attributes as objects and the bridge calls
    # encode_attrs when a backward is traced (Note [Eager context state]).
    keeps_ctx_objects: bool

    def convert_args(self, args: tuple) -> tuple: ...

    def outputs(self, out: Any) -> tuple:
        """What forward returned, as a tuple of n_out tensors, or an error."""

    def encode_ctx(self, ctx: Any) -> tuple:
        """(state, state ints, saved tensors) of a ctx with attributes."""

    def raise_modified_input(self, index: int) -> NoReturn: ...


@runtime_checkable
class BackwardRunnerProtocol(Protocol):
    """What the C++ backward kernel reads (``backward_spec`` in python_kernel.cpp)."""

    fn_name: str
    backward: Callable  # backward(ctx, *grads)
    tensor_flags: tuple  # per forward argument: whether it is a tensor

    def decode_ctx(self, state: str, saved: tuple, state_ints) -> tuple:
        """(saved tensors, attribute dict) from `_bwd`'s state arguments."""

    def fix_gradient_count(self, res: tuple) -> tuple: ...

    def raise_bad_gradients(self, res: tuple) -> NoReturn: ...


def check_tensor_outputs(fn_name: str, outs: tuple) -> None:
    if not outs:
        raise SchemaError(
            f"torch_opaque: {fn_name}.forward returned no tensors; an opaque op needs at "
            f"least one output."
        )
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            raise SchemaError(
                f"torch_opaque: {fn_name}.forward returned a {type(o).__name__} as output {k}; "
                f"opaque ops return tensors only. Return a tensor (e.g. torch.tensor(value)) "
                f"or keep this Function unwrapped."
            )


def modified_input_error(fn_name: str, arg) -> UnsupportedError:
    """Note [In-place forwards] (csrc/python/python_kernel.cpp)."""
    what = f"argument '{arg}'" if isinstance(arg, str) else f"argument {arg}"
    return UnsupportedError(
        f"torch_opaque: {fn_name}.forward modified its {what} in place. An opaque op "
        f"must not mutate its inputs (compiled graphs would compute wrong values): "
        f"modify a copy (x = x.clone()) and return it, or keep this Function unwrapped."
    )


class ForwardChecks:
    """The forward runners' error paths; needs ``fn_name``, ``n_out`` and
    ``arg_names`` (empty when unknown)."""

    fn_name: str
    n_out: int
    arg_names: tuple = ()

    def outputs(self, out) -> tuple:
        if self.n_out == 1 and type(out) is torch.Tensor:
            return (out,)
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != self.n_out:
            raise RuntimeError(
                f"torch_opaque: {self.fn_name}.forward returned {len(outs)} outputs, but its "
                f"op was defined with {self.n_out} (from the first call or the return "
                f"annotation). A wrapped Function must always return the same number of "
                f"tensors for the same kinds of arguments."
            )
        check_tensor_outputs(self.fn_name, outs)
        return outs

    def raise_modified_input(self, index: int) -> NoReturn:
        names = self.arg_names
        raise modified_input_error(self.fn_name, names[index] if index < len(names) else index)


class BackwardChecks:
    """The backward runners' error paths; needs ``fn_name``, ``tensor_flags``
    and ``arg_names``."""

    fn_name: str
    tensor_flags: tuple
    arg_names: tuple

    def fix_gradient_count(self, res: tuple) -> tuple:
        """Extra trailing Nones are dropped (as stock autograd does); any other
        count is an error."""
        n = len(self.tensor_flags)
        if len(res) > n and all(r is None for r in res[n:]):
            return res[:n]
        raise RuntimeError(
            f"torch_opaque: {self.fn_name}.backward returned an incorrect number of "
            f"gradients (expected {n}, got {len(res)}). Return one "
            f"gradient (or None) per forward argument."
        )

    def raise_bad_gradients(self, res: tuple) -> NoReturn:
        for i, g in enumerate(res):
            if g is None:
                continue
            if not self.tensor_flags[i]:
                raise RuntimeError(
                    f"torch_opaque: {self.fn_name}.backward returned a gradient different "
                    f"than None at position {i + 1}, but the corresponding forward input "
                    f"'{self.arg_names[i]}' is not a Tensor. Return None there."
                )
            if not isinstance(g, torch.Tensor):
                raise TypeError(
                    f"torch_opaque: {self.fn_name}.backward returned a {type(g).__name__} at "
                    f"position {i + 1}; gradients must be tensors or None."
                )
        raise AssertionError(f"torch_opaque: {self.fn_name}: no bad gradient in {res!r}")


def new_dynamic_size(min: int, max):
    """A new data-dependent (unbacked) size for a C++ fake's
    ``ctx.new_dynamic_size()`` (Note [Data-dependent sizes] in
    include/torch_opaque/fake_checks.h): from the fake tracing context, as
    ``torch.library.get_ctx().new_dynamic_size()`` gives in a Python fake."""
    ctx = fake_impl.global_ctx_getter()
    if ctx is None:
        mode = torch._guards.detect_fake_mode()
        if mode is None:
            mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if mode is None:
            raise RuntimeError(
                "torch_opaque: ctx.new_dynamic_size() creates a data-dependent size while "
                "torch.export or torch.compile traces the op with fake tensors; there is no "
                "fake tensor mode here. Call the op on real tensors, or trace it."
            )
        ctx = fake_impl.FakeImplCtx(mode, None)
    return ctx.new_dynamic_size(min=min, max=max)

