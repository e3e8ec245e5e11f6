"""``torch_opaque.save`` keeps only what ``torch_opaque.load`` reads back.

Note [Saving reads back what it wrote]
torch.export.save can write programs that its own loader refuses (Note
[Higher-order ops in archives] in hop_forms.py), and torch_opaque.load reads
an archive against a closed grammar of its own (Note [Reading pt2 without
unpickling] in program.py). So ``save`` reads back every program it writes the
way ``load`` does, in the saving process (where the program's ops are
registered, so only what the file says is checked):

* each stored program of a self-contained archive as soon as it is serialized
  (:func:`stored_program_bytes`): the grammar, torch's deserializer and
  verifier, and the checks of stored graphs, as ``load`` reads it;
* the archive's own program once the archive is written (:func:`write_checked`):
  its manifest and graph against the grammar, then torch's deserializer and
  verifier, with the weights of the program in memory (the graph, not the
  bytes of the weights, is what may not read back).

A program that does not read back is an ArchiveError that names it and why,
and nothing is left behind: a path is removed, a file object is written only
after the check. Sizes are not checked here (an archive beyond the default
``ArchiveLimits`` loads with raised limits); what only another process lacks
(a module it may not import) is ``load``'s to say (OpNotAllowedError).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os

import torch

from ..errors import ArchiveError
from .hop_forms import explain_serialize_error, serializer_forms
from .program import deserialize, program_from_bytes
from .reader import read_contents
from .zipio import ArchiveLimits, ZipReader, describe

_UNBOUNDED = 1 << 62
# no size limits: sizes are the loading side's choice (ArchiveLimits)
_LIMITS = ArchiveLimits(
    manifest=_UNBOUNDED, model=_UNBOUNDED, program=_UNBOUNDED, tensors=_UNBOUNDED,
    other=_UNBOUNDED, metadata=_UNBOUNDED, ratio=_UNBOUNDED, entries=_UNBOUNDED, nodes=_UNBOUNDED,
)  # fmt: skip


def _not_read_back(what: str, e: Exception) -> ArchiveError:
    return ArchiveError(
        f"torch_opaque.save: {what} does not load back, so nothing was written: reading it "
        f"the way torch_opaque.load does fails ({e}). torch's serializer wrote a form that "
        f"its reader (or torch_opaque's) refuses; please report it with the program."
    )


def stored_program_bytes(prog, what: str) -> str:
    """A stored program as ``torch.export.save`` bytes in base64, once it reads
    back (see the Note); ``what`` names it in errors ("the stored forward
    program of ns::Name.overload")."""
    buf = io.BytesIO()
    try:
        with serializer_forms():
            torch.export.save(prog, buf)
    except RuntimeError as e:
        raise ArchiveError(
            f"torch_opaque.save(self_contained=True): torch's serializer cannot write {what}: "
            f"{explain_serialize_error(e)}. Save without self_contained=True (loading then "
            f"imports the defining module), or change the Function as the message says."
        ) from e
    data = buf.getvalue()
    try:
        program_from_bytes(data, "the archive being saved", what, _LIMITS, {})
    except ArchiveError as e:
        raise _not_read_back(what, e) from e
    return base64.b64encode(data).decode("ascii")


def _read_back(source, ep, description: str) -> None:
    with ZipReader(source, description, _LIMITS) as z:
        contents = read_contents(z)
        model = contents.models.get("model")
    if model is None:
        raise ArchiveError(f"{description} holds no 'model'")
    tensors = (dict(ep.state_dict), dict(ep.constants))
    deserialize(model, tensors, description, "models/model.json", {}, _LIMITS)


def write_checked(ep, path, extra: dict) -> None:
    """``torch.export.save(ep, path, extra_files=extra)``, kept only when the
    program reads back (see the Note)."""
    description = describe(path)
    to_path = isinstance(path, (str, os.PathLike))
    target = path if to_path else io.BytesIO()

    def remove():
        if to_path:
            with contextlib.suppress(OSError):
                os.remove(path)

    try:
        with serializer_forms():
            torch.export.save(ep, target, extra_files=extra)
    except RuntimeError as e:
        remove()
        raise ArchiveError(
            f"torch_opaque.save: cannot write {description}: {explain_serialize_error(e)}"
        ) from e
    try:
        _read_back(path if to_path else io.BytesIO(target.getvalue()), ep, description)
    except ArchiveError as e:
        remove()
        raise _not_read_back(f"the program saved to {description}", e) from e
    if not to_path:
        path.write(target.getvalue())
