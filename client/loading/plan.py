"""Cutting stored tensors into bounded reads: which bytes of which tensor each read fills.

Tensors stored back to back in one shard are read together; a read never exceeds a byte
budget, so a big tensor spans several reads and one read may cover pieces of many small
tensors. Plain integers only: the reader maps the pieces onto tensor memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class Located(Protocol):
    """Where one item's bytes are: a shard, an offset in it and a length (> 0)."""

    @property
    def shard_id(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Stored:
    """A :class:`Located` item of the caller's own making."""

    shard_id: str
    offset: int
    nbytes: int


class Piece(NamedTuple):
    """Bytes ``start`` to ``start + length`` of item number ``item``; ``last`` when they end it.

    A named tuple: a read of many small tensors makes one per tensor.
    """

    item: int
    start: int
    length: int
    last: bool


@dataclass
class ReadUnit:
    """One read: ``nbytes`` consecutive bytes of a shard from ``offset``, split into pieces."""

    shard_id: str
    offset: int
    pieces: list[Piece] = field(default_factory=list)
    nbytes: int = 0


def plan_reads(items: Sequence[Located], unit_bytes: int) -> list[ReadUnit]:
    """Cut ``items`` (sorted by shard and offset, not overlapping) into reads of at most ``unit_bytes``.

    A read covers only consecutive bytes: a gap between items, or another shard, starts a
    new one. Every item's pieces appear in order and together cover it exactly.

    Raises:
        ValueError: ``unit_bytes`` or an item's length is not positive.
    """
    if unit_bytes < 1:
        raise ValueError(f"unit_bytes {unit_bytes} is not positive")
    if any(item.nbytes < 1 for item in items):
        raise ValueError("every item must hold at least one byte")
    units: list[ReadUnit] = []
    current: ReadUnit | None = None
    for index, item in enumerate(items):
        shard_id, offset, nbytes = item.shard_id, item.offset, item.nbytes
        if current is None or current.shard_id != shard_id or current.offset + current.nbytes != offset:
            current = _start(units, shard_id, offset)
        if current.nbytes + nbytes <= unit_bytes:  # the whole item in this read: most items of a large model
            current.pieces.append(Piece(index, 0, nbytes, True))
            current.nbytes += nbytes
            continue
        done = 0
        while done < nbytes:
            if current.nbytes == unit_bytes:
                current = _start(units, shard_id, offset + done)
            length = min(unit_bytes - current.nbytes, nbytes - done)
            current.pieces.append(Piece(index, done, length, done + length == nbytes))
            current.nbytes += length
            done += length
    return units


def _start(units: list[ReadUnit], shard_id: str, offset: int) -> ReadUnit:
    unit = ReadUnit(shard_id, offset)
    units.append(unit)
    return unit


def batch_units(units: Sequence[ReadUnit], max_bytes: int, max_units: int) -> list[list[ReadUnit]]:
    """Group consecutive ``units`` into batches of at most ``max_bytes`` and ``max_units`` each,
    in order, for a store that answers many ranges in one request.

    A unit larger than ``max_bytes`` makes a batch of its own.

    Raises:
        ValueError: ``max_bytes`` or ``max_units`` is not positive.
    """
    if max_bytes < 1 or max_units < 1:
        raise ValueError(f"batch limits {max_bytes} bytes, {max_units} units must be positive")
    batches: list[list[ReadUnit]] = []
    size = 0
    for unit in units:
        if not batches or size + unit.nbytes > max_bytes or len(batches[-1]) == max_units:
            batches.append([])
            size = 0
        batches[-1].append(unit)
        size += unit.nbytes
    return batches
