"""Checkpoint paths in trainers' terms: ``ckptstore://RUN@REF`` and file names as tags.

Trainers name checkpoints by path (``.../checkpoints/epoch=3-step=400.ckpt``). A plug-in stores
each as a version of its run and gives the version a tag made from the file name, so the
trainer's own bookkeeping (top-k, ``last``, resume by path) keeps working on versions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from blake3 import blake3

from ckptstore.service.errors import InvalidNameError
from ckptstore.service.format.names import LATEST, parse_ref, validate_run_id, validate_tag

SCHEME = "ckptstore://"
_NOT_IN_TAGS = re.compile(r"[^A-Za-z0-9._-]")
#: Room kept for the ``-<8 hex>`` suffix a rewritten name gets, within the 64-character tag limit.
_STEM_ROOM = 64 - 9


@dataclass(frozen=True)
class StoreRef:
    """A version of a run, as ``ckptstore://RUN@REF`` names it (REF: number, ``latest`` or tag)."""

    run_id: str
    ref: int | str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}@{self.ref}"


def parse_store_path(path: object) -> StoreRef | None:
    """The :class:`StoreRef` of a ``ckptstore://RUN[@REF]`` path (REF absent: latest); None for other paths.

    Raises:
        InvalidNameError: the path starts with ``ckptstore://`` but RUN or REF is malformed.
    """
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.startswith(SCHEME):
        return None
    run_id, sep, ref = text[len(SCHEME) :].partition("@")
    if sep and not ref:
        raise InvalidNameError(f"{text!r}: nothing after '@'; write ckptstore://RUN@REF, e.g. my-run@3 or my-run@best")
    try:
        return StoreRef(validate_run_id(run_id), parse_ref(ref) if sep else LATEST)
    except InvalidNameError as exc:
        raise InvalidNameError(f"{text!r}: {exc.message}") from exc


def tag_for_path(path: str | os.PathLike[str]) -> str:
    """The tag a trainer's checkpoint path is stored under: its file name without the extension.

    A name that is already a valid tag (``last``, ``best-v1``) is used as it is. Any other
    (``epoch=3-step=400``) has each character a tag cannot hold replaced by ``_``, and gets
    ``-`` plus 8 hex digits of the name's hash, so two names never share a tag. The folder is
    not part of the tag: one run holds one checkpoint folder's files.
    """
    stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    try:
        return validate_tag(stem)
    except InvalidNameError:
        pass
    cleaned = _NOT_IN_TAGS.sub("_", stem)[:_STEM_ROOM]
    if not cleaned[:1].isalpha():
        cleaned = "c" + cleaned[: _STEM_ROOM - 1]
    return validate_tag(f"{cleaned}-{blake3(stem.encode()).hexdigest()[:8]}")
