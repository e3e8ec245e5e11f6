"""What a Function the loading process owns gives, learnt before an archive's
claims about it are accepted (Note [The caller's own ops]).

Note [The caller's own ops]
An archive can never change or break an op the process already has. A
manifest that names a Function of this process (one it imported, or one an
allowed module defines) says how many outputs each overload has, whether it
returns a tuple and which arguments it modifies; ``torch_opaque.load`` defines
missing overloads from those claims without calling the Function's real
kernels. Every claim that can be checked is checked before anything is
defined or registered, and a conflict refuses the archive naming the op, the
class and the field: against an overload the process has, the forward's
return annotation, and otherwise the forward run once on fake tensors of the
overload's kinds of arguments (empty tensors, zero numbers; the run the
Function's own first call would make when traced). Only a forward that cannot
run on those fake tensors keeps the claim unchecked at load; its first call
then confirms it (Note [Archive claims] in _impl/opaque_function.py).
"""

from __future__ import annotations

from typing import Optional


def fake_outputs(fn, specs, values) -> Optional[tuple]:
    """(number of outputs, returns a tuple) of ``fn``'s forward run on fake
    tensors of ``values``' kinds (learning its in-place pairs too), or None
    when it cannot run on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        # under a fake mode the probe never falls back to a real call
        with FakeTensorMode(allow_non_fake_inputs=True):
            return fn._probe(specs, values)
    except Exception:  # the forward cannot run on fake example values
        return None
