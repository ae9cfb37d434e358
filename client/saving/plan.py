"""What a save does, decided without I/O: which tensors go unhashed, which are hashed in which
group, which digests to ask the store about, and which tensors to send.

A save's tensors are known by index. The plan is made from their sizes, the digests the
client's cache already knows, which tensors changed in place since the client's last save,
and which tensor objects appear under several keys. As groups are hashed, :class:`SavePlan`
tells the runner (:mod:`client.saving.saver`) what to ask and what to send, and keeps the sizes
of the digests this version references. :class:`SeparatePacker` keeps tensors of different
kinds (frozen, trainable) out of each other's shards. Everything here works on plain ints and
strings.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ckptstore.service.format.sharding import ShardPacker

T = TypeVar("T")


@dataclass
class Sending:
    """What to do with one hashed group: the indexes to send, and the bytes skipped (stored
    already, sent under an earlier key, or empty)."""

    indexes: list[int]
    skipped_bytes: int


@dataclass
class SavePlan:
    """One save's decisions, and what it has learnt so far.

    Build it with :func:`plan_save`. Then, per group in :attr:`groups`: hash it, call
    :meth:`to_ask` with the digests, ask the store which of those it lacks, and call
    :meth:`to_send` with the answer. Tensors the store took unhashed are recorded with
    :meth:`took_unhashed`.
    """

    lengths: list[int]
    #: Indexes handed to the store unhashed (it hashes them as it writes them).
    write_first: list[int]
    #: The other indexes, in order, cut into groups of about one shard of bytes to hash.
    groups: list[list[int]]
    #: Digests the last committed version references: stored, so never asked about.
    committed: frozenset[str] = frozenset()
    #: Size of every digest this version references, by digest.
    sizes: dict[str, int] = field(default_factory=dict)
    #: Digests this save sent (or the store took unhashed).
    sent: set[str] = field(default_factory=set)

    def to_ask(self, group: Sequence[int], digests: Sequence[str]) -> list[str]:
        """Record the digests of a hashed ``group`` (in its order); returns the ones to ask the
        store about: non-empty, new to this save and not in the last committed version."""
        fresh: list[str] = []
        for index, digest in zip(group, digests, strict=True):
            nbytes = self.lengths[index]
            if nbytes > 0 and digest not in self.sizes:
                self.sizes[digest] = nbytes
                fresh.append(digest)
        return [digest for digest in fresh if digest not in self.committed]

    def to_send(self, group: Sequence[int], digests: Sequence[str], absent: set[str]) -> Sending:
        """Which indexes of ``group`` to send, given the digests the store said it lacks:
        the first index of each absent digest not sent already."""
        indexes, skipped = [], 0
        for index, digest in zip(group, digests, strict=True):
            if digest in absent and digest not in self.sent:
                indexes.append(index)
                self.sent.add(digest)
            else:
                skipped += self.lengths[index]
        return Sending(indexes, skipped)

    def took_unhashed(self, index: int, digest: str) -> None:
        """Record the digest the store found for a tensor it took unhashed."""
        self.sizes[digest] = self.lengths[index]
        self.sent.add(digest)

    def bytes_sent(self) -> int:
        """Bytes of the tensors this save sent."""
        return sum(self.sizes[digest] for digest in self.sent)


def plan_save(
    lengths: Sequence[int],
    known: Sequence[str | None],
    *,
    shard_bytes: int,
    likely_new: Sequence[bool] | None = None,
    holders: Sequence[int] | None = None,
    committed: frozenset[str] = frozenset(),
) -> SavePlan:
    """Plan a save of tensors of ``lengths`` bytes.

    Args:
        lengths: each tensor's size in bytes.
        known: each tensor's digest from the cache, or None where it must be hashed.
        shard_bytes: about how many bytes to hash per group (one shard's worth).
        likely_new: for a store that takes tensors unhashed, whether each tensor is almost
            surely not stored (one of the last save's that changed in place since, or of a
            size no stored tensor has), so it goes unhashed; None: the store hashes nothing itself.
        holders: how many keys hold each tensor's object (a tied weight: more than one);
            only a tensor held once goes unhashed. By default every tensor is held once.
        committed: the digests the last committed version references.
    """
    count = len(lengths)
    holders = holders if holders is not None else [1] * count
    write_first = []
    if likely_new is not None:
        write_first = [
            i for i in range(count) if likely_new[i] and known[i] is None and lengths[i] > 0 and holders[i] == 1
        ]
    unhashed = set(write_first)
    packer: ShardPacker[int] = ShardPacker(shard_bytes, keep_empty=True)
    groups = []
    for index in range(count):
        if index in unhashed:
            continue
        closed = packer.add(index, 0 if known[index] is not None else lengths[index])
        if closed is not None:
            groups.append(closed)
    last = packer.flush()
    if last is not None:
        groups.append(last)
    return SavePlan(list(lengths), write_first, groups, committed)


class SeparatePacker(Generic[T]):
    """Packs items into shards of about ``shard_bytes`` each, never two kinds in one shard.

    A save packs frozen tensors (``trainable`` False) apart from everything that changes as
    training goes (trainable weights, optimizer state): garbage collection keeps a shard
    whole while any tensor in it is referenced, so a frozen base packed beside one save's
    trainable tensors would keep those alive as long as any later version uses the base, and
    two saves racing to store the same base would each keep a copy. Kept apart, a frozen
    shard is the same for every save that packs the same frozen tensors (content-addressed,
    stored once), and a trainable shard is reclaimed with the versions that use it.

    Each kind fills its own open shard; shards close as :class:`ShardPacker` closes them.
    """

    def __init__(self, shard_bytes: int, *, fill: bool = False) -> None:
        self.shard_bytes = shard_bytes
        self.fill = fill  # see ShardPacker
        self._packers: dict[Hashable, ShardPacker[T]] = {}

    def add(self, item: T, nbytes: int, kind: Hashable) -> list[T] | None:
        """Add ``item`` of ``kind``; returns the shard of that kind it closed, if it closed one."""
        packer = self._packers.get(kind)
        if packer is None:
            packer = self._packers[kind] = ShardPacker(self.shard_bytes, fill=self.fill)
        return packer.add(item, nbytes)

    def flush(self) -> list[list[T]]:
        """The open shards, one per kind that has one; the packer starts afresh."""
        closed = [packer.flush() for packer in self._packers.values()]
        return [group for group in closed if group is not None]


#: Shards a save splits its bytes into for balance are never smaller than this (a shard file
#: costs a header, an fsync and a row; a small save is one shard).
MIN_BALANCED_SHARD_BYTES = 64 << 20


def balanced_shard_bytes(total: int, shard_bytes: int, writers: int) -> int:
    """A shard size for cutting ``total`` bytes, with :class:`ShardPacker`'s ``fill``, into a
    whole number of rounds of ``writers`` shards of about equal size, none above ``shard_bytes``
    by more than one tensor, so every writer has a shard until the end.

    Filling shards to ``shard_bytes`` in order left the last one alone at the end: 750 MiB in
    three shards of 256 MiB, two written at a time, wrote the third on one thread; 256 MiB as one
    shard of 206 MiB and one of 50 MiB wrote most of it on one thread. Shards stay at least
    :data:`MIN_BALANCED_SHARD_BYTES` (unless ``shard_bytes`` is smaller).
    """
    if total <= 0 or writers <= 1:
        return shard_bytes
    shards = writers * -(-total // (writers * shard_bytes))
    return min(shard_bytes, max(MIN_BALANCED_SHARD_BYTES, -(-total // shards)))
