"""Manifest parts: a manifest's tensor entries split into content-addressed groups, stored once.

A stored version keeps its manifest as a *head* (the manifest with an empty ``tensors`` list)
and the ordered list of the parts its entries fall into. Consecutive versions of a run share
every part but those holding a changed entry, so a version that changes k of n tensors adds
about k parts, not n entries (as git trees or OCI manifest lists share unchanged pieces).

Where a part ends depends on the entries' keys only, never on their digests: an entry ends a
part when the CRC-32 of its key is 0 modulo :data:`BOUNDARY_MODULUS` and the part holds at
least :data:`MIN_ENTRIES`, or when the part reaches :data:`MAX_ENTRIES`. A changed tensor
therefore changes exactly one part, and an added or removed key changes the part around it
(the split falls back into step at the next key-defined boundary).

A part's body is the JSON array of its entries exactly as the manifest lists them (compact,
absent optional fields left out), and its digest is the BLAKE3 of that text. Assembling the
manifest again splices the parts' arrays into the head, so the text read back is the text
that splitting took apart (see ``docs/FORMAT.md``).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blake3 import blake3
from pydantic_core import to_json

if TYPE_CHECKING:
    from ckptstore.service.format.manifest import Manifest, TensorEntry

#: An entry whose key's CRC-32 is 0 modulo this ends a part (once the part has MIN_ENTRIES).
BOUNDARY_MODULUS = 16
MIN_ENTRIES = 16
MAX_ENTRIES = 256
_EMPTY_TENSORS = '"tensors":[]'
_HEAD_PREFIX = '{"format":"ckptstore.manifest/1","digest_algorithm":"blake3",' + _EMPTY_TENSORS
_EMPTY_STATE = ',"state":{}'


@functools.cache
def _entries_adapter() -> Any:
    """The serializer of a part's entries. Built on first use: reading a manifest back only
    splices text, and a listing command must not pay for the manifest models' import."""
    from pydantic import TypeAdapter

    from ckptstore.service.format.manifest import TensorEntry

    return TypeAdapter(list[TensorEntry])


@dataclass(frozen=True)
class Part:
    """One group of consecutive entries: its digest, its JSON text and the digests it references."""

    digest: str
    body: str
    entries: Sequence[TensorEntry]

    def tensor_digests(self) -> set[str]:
        """Every stored piece's digest its entries name."""
        return {d for entry in self.entries for d in entry.digests()}


def boundaries(keys: Sequence[str]) -> list[int]:
    """The end index (exclusive) of each part of entries with these keys, in order."""
    ends: list[int] = []
    start = 0
    for index, key in enumerate(keys):
        length = index + 1 - start
        natural = length >= MIN_ENTRIES and zlib.crc32(key.encode()) % BOUNDARY_MODULUS == 0
        if natural or length >= MAX_ENTRIES:
            ends.append(index + 1)
            start = index + 1
    if start < len(keys):
        ends.append(len(keys))
    return ends


def part_of(entries: Sequence[TensorEntry]) -> Part:
    """The part holding ``entries`` (already validated) in their order."""
    body = _entries_adapter().dump_json(list(entries), exclude_none=True).decode()
    return Part(blake3(body.encode()).hexdigest(), body, entries)


def split(entries: Sequence[TensorEntry]) -> list[Part]:
    """``entries`` cut into parts at their keys' boundaries, in order."""
    parts = []
    start = 0
    for end in boundaries([entry.key for entry in entries]):
        parts.append(part_of(entries[start:end]))
        start = end
    return parts


def head_json(manifest: Manifest) -> str:
    """The manifest's JSON text without its tensor entries (an empty ``tensors`` list).

    The state tree is written by :func:`json_text` in slices, the rest as pydantic writes it:
    a state of a million keys written in one call held the GIL for 50-70 ms, and a server
    answered nothing else meanwhile.
    """
    empty = manifest.model_copy(update={"tensors": [], "state": {}}).model_dump_json(exclude_none=True)
    state_at = len(_HEAD_PREFIX) + len(_EMPTY_STATE)
    if not empty.startswith(_HEAD_PREFIX + _EMPTY_STATE):  # pragma: no cover - the field order is the model's
        raise AssertionError(f"unexpected manifest head {empty[:80]!r}")
    return empty[: state_at - 2] + json_text(manifest.state) + empty[state_at:]


#: Most values :func:`json_text` writes in one call (a call holds the GIL from start to end).
SLICE_VALUES = 4096


def json_text(value: Any) -> str:
    """``value`` (a JSON tree) as compact JSON text, exactly as ``pydantic_core.to_json`` writes it,
    in calls of at most about :data:`SLICE_VALUES` values each, so that other threads run between."""
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def _values(value: Any, limit: int) -> int:
    """How many values ``value`` holds, itself included, counted up to just past ``limit``."""
    count, todo = 0, [value]
    while todo and count <= limit:
        item = todo.pop()
        count += 1
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return count


def _write(value: Any, out: list[str]) -> None:
    if _values(value, SLICE_VALUES) <= SLICE_VALUES or not isinstance(value, (dict, list)):
        out.append(to_json(value).decode())
        return
    is_dict = isinstance(value, dict)
    out.append("{" if is_dict else "[")
    batch: list[Any] = []
    counted = 0
    wrote = False

    def flush() -> None:
        nonlocal batch, counted, wrote
        if batch:
            text = to_json(dict(batch) if is_dict else batch).decode()[1:-1]
            out.append(("," if wrote else "") + text)
            wrote = True
        batch, counted = [], 0

    items: Any = value.items() if isinstance(value, dict) else value
    for item in items:
        inner = item[1] if is_dict else item
        size = _values(inner, SLICE_VALUES)
        if size > SLICE_VALUES:  # a large value of its own: written in slices itself
            flush()
            out.append(("," if wrote else "") + (to_json(item[0]).decode() + ":" if is_dict else ""))
            _write(inner, out)
            wrote = True
            continue
        batch.append(item)
        counted += size
        if counted >= SLICE_VALUES:
            flush()
    flush()
    out.append("}" if is_dict else "]")


def assemble(head: str, bodies: Sequence[str]) -> str:
    """The whole manifest's JSON text: ``head`` with the parts' entries spliced in, in order."""
    if not head.startswith(_HEAD_PREFIX):
        raise ValueError("a stored manifest head does not start with its format and an empty tensors list")
    inner = ",".join(body[1:-1] for body in bodies if body != "[]")
    return head[: len(_HEAD_PREFIX) - 1] + inner + head[len(_HEAD_PREFIX) - 1 :]


__all__ = [
    "BOUNDARY_MODULUS",
    "MAX_ENTRIES",
    "MIN_ENTRIES",
    "Part",
    "assemble",
    "boundaries",
    "head_json",
    "json_text",
    "split",
]
