"""Shard planning on plain sizes: which tensors go together into which shard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

DEFAULT_SHARD_BYTES = 256 << 20
#: Keeps a shard's JSON header far below the header cap.
MAX_TENSORS_PER_SHARD = 50_000


def plan_shards(
    items: Sequence[tuple[T, int]],
    target_bytes: int = DEFAULT_SHARD_BYTES,
    max_tensors: int = MAX_TENSORS_PER_SHARD,
) -> list[list[T]]:
    """Group ``(item, nbytes)`` pairs into shards of about ``target_bytes`` each.

    Items keep their order. A shard closes when the next item would push it past the
    target or past ``max_tensors``; an item larger than the target gets a shard of its own.
    Empty items are not placed (they need no storage).
    """
    if target_bytes <= 0 or max_tensors <= 0:
        raise ValueError("target_bytes and max_tensors must be positive")
    shards: list[list[T]] = []
    current: list[T] = []
    current_bytes = 0
    for item, nbytes in items:
        if nbytes <= 0:
            continue
        if current and (current_bytes + nbytes > target_bytes or len(current) >= max_tensors):
            shards.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards
