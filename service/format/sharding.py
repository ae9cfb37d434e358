"""Shard planning on plain sizes: which tensors go together into which shard."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

DEFAULT_SHARD_BYTES = 256 << 20
#: The ``__metadata__`` of every shard ckptstore writes.
SHARD_METADATA = {"format": "ckptstore.shard/1"}
#: Keeps a shard's JSON header far below the header cap.
MAX_TENSORS_PER_SHARD = 50_000
#: Most tensor sizes one question to a server may hold (``POST /v1/tensors/sizes``).
MAX_SIZES_PER_REQUEST = 4096


class ShardPacker(Generic[T]):
    """Packs items, in the order given, into groups of about ``target_bytes`` each.

    A group closes when the next item would push it past the target or past ``max_tensors``
    items; an item larger than the target gets a group of its own. With ``fill``, a group
    instead closes once it holds the target or more (the item reaching it joins it), so
    items of ``T`` bytes in all, cut with a target of ``T / k``, make at most ``k`` groups and
    none is a small remainder. Items of no bytes are dropped unless ``keep_empty`` (then they
    ride along and weigh nothing).
    """

    def __init__(
        self,
        target_bytes: int = DEFAULT_SHARD_BYTES,
        max_tensors: int = MAX_TENSORS_PER_SHARD,
        *,
        keep_empty: bool = False,
        fill: bool = False,
    ) -> None:
        if target_bytes <= 0 or max_tensors <= 0:
            raise ValueError("target_bytes and max_tensors must be positive")
        self.target_bytes = target_bytes
        self.max_tensors = max_tensors
        self.keep_empty = keep_empty
        self.fill = fill
        self._current: list[T] = []
        self._current_bytes = 0

    def add(self, item: T, nbytes: int) -> list[T] | None:
        """Add ``item``; returns the group it closed, if adding it closed one."""
        if nbytes <= 0 and not self.keep_empty:
            return None
        closed = None
        if self._current and (
            (not self.fill and self._current_bytes + nbytes > self.target_bytes)
            or len(self._current) >= self.max_tensors
        ):
            closed, self._current, self._current_bytes = self._current, [], 0
        self._current.append(item)
        self._current_bytes += max(nbytes, 0)
        if self.fill and self._current_bytes >= self.target_bytes and closed is None:
            closed, self._current, self._current_bytes = self._current, [], 0
        return closed

    def flush(self) -> list[T] | None:
        """The last, open group (None if empty); the packer starts afresh."""
        closed, self._current, self._current_bytes = self._current or None, [], 0
        return closed


def plan_shards(
    items: Sequence[tuple[T, int]],
    target_bytes: int = DEFAULT_SHARD_BYTES,
    max_tensors: int = MAX_TENSORS_PER_SHARD,
) -> list[list[T]]:
    """Group ``(item, nbytes)`` pairs into shards of about ``target_bytes`` each (see :class:`ShardPacker`).

    Items keep their order. Empty items are not placed (they need no storage).
    """
    packer: ShardPacker[T] = ShardPacker(target_bytes, max_tensors)
    shards = [group for item, nbytes in items if (group := packer.add(item, nbytes)) is not None]
    last = packer.flush()
    return shards + [last] if last is not None else shards


# -- tensors sent before their digests are known -------------------------------------------------


class UnhashedTensor(NamedTuple):
    """A tensor to store whose digest is not known: its dtype name, shape and raw bytes.

    A named tuple: a save of 32,768 small tensors makes one each, and a frozen dataclass cost
    three times as much to make.
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


#: Tensors up to this size are hashed before they are written, and written only if no tensor
#: before them had their digest: sampling them first to tell them apart cost as much as hashing
#: them, and their bytes are still in the CPU's cache when they are copied. The caller's memory
#: must hold still while the shard is written, as it must for any tensor hashed first (a
#: client's save hands tensors of up to this size over in a copy of its own).
HASH_FIRST_BYTES = 64 << 10

#: Bytes sampled at each end and in the middle of a tensor to tell it from the ones before it.
_SAMPLE_BYTES = 64


def fingerprint(tensor: UnhashedTensor) -> tuple[str, tuple[int, ...], bytes]:
    """What two equal tensors surely share: dtype, shape and the bytes at a few places (different
    fingerprints prove the tensors differ; equal ones prove nothing)."""
    data, middle = tensor.data, tensor.data.nbytes // 2
    if data.nbytes <= 3 * _SAMPLE_BYTES:
        return tensor.dtype, tensor.shape, bytes(data)
    sampled = data[:_SAMPLE_BYTES].tobytes() + data[middle : middle + _SAMPLE_BYTES].tobytes()
    return tensor.dtype, tensor.shape, sampled + data[-_SAMPLE_BYTES:].tobytes()


#: Most dimensions of one tensor in a layout.
MAX_DIMENSIONS = 64


def encode_layout(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The start of an unhashed upload's body: the length prefix and the layout of ``tensors``
    (dtype name, shape), whose bytes follow in this order."""
    text = json.dumps([[dtype, list(shape)] for dtype, shape in tensors], separators=(",", ":")).encode("ascii")
    return struct.pack("<Q", len(text)) + text
