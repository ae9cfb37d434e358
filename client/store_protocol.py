"""The protocol the client reaches a store through: in-process (embedded) or over HTTP.

Both speak the same protocol, so save and load run one code path. The embedded
transport *is* the engine's :class:`service.store.Store`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ckptstore.service.format.manifest import Manifest, ManifestBody
from ckptstore.service.format.records import (
    GcReport,
    MetadataProblem,
    RetentionPolicy,
    RunInfo,
    ShardReceipt,
    TensorLocation,
    VersionInfo,
)
from ckptstore.service.format.sharding import UnhashedTensor


class Transport(Protocol):
    """The operations a client needs from a store, in the order a save or load calls them.

    Optional capability: a store with ``takes_unhashed`` True also implements
    :meth:`put_tensors`, taking tensors whose digests the caller does not know (the embedded
    store hashes them as it writes them), and :meth:`sizes_held`; a save then sends unhashed
    the tensors that changed in place and those of a size the store holds no tensor of. A store
    that learns whether it takes them from its first :meth:`sizes_held` answer (a server) says
    so with ``may_take_unhashed``: True until that answer says otherwise, asking nothing.
    A store with a ``read_ranges(ranges)`` method (a server) answers many ``(shard_id, offset,
    buffers)`` ranges in one request; a load then batches its reads of many shards. A store
    with ``remote`` True (a server) does its work, such as a garbage collection, elsewhere.

    A save names itself from its first call by its commit key, passed as ``save_key`` to
    :meth:`missing`, :meth:`put_shard` and :meth:`put_tensors` and as ``commit_key`` to
    :meth:`commit`: the store holds what it reports present and what it stores for that save
    until it commits (garbage collection keeps it, whatever its grace), while the save keeps
    calling (``service.db.holds``).
    """

    #: Whether :meth:`put_tensors` is available.
    takes_unhashed: bool

    @property
    def location(self) -> str:
        """Where the store is, for people, secrets masked: a server's URL, or the database and
        blob store a process opened itself."""

    def missing(self, digests: Iterable[str], *, save_key: str | None = None) -> list[str]:
        """Digests the store lacks; those it has are held for the save ``save_key`` names."""

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> ShardReceipt:
        """Store a shard given as header bytes and its tensors' bytes (verified by the store), held
        for the save ``save_key`` names."""

    def put_tensors(
        self,
        tensors: Sequence[UnhashedTensor],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> tuple[ShardReceipt, list[str]]:
        """Store tensors not hashed yet as one shard; returns the receipt and their digests in order
        (only where ``takes_unhashed``)."""

    def sizes_held(self, sizes: Iterable[int]) -> set[int]:
        """Those of ``sizes`` (byte lengths) some stored tensor has (only where ``takes_unhashed``)."""

    def commit(
        self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = (), commit_key: str | None = None
    ) -> VersionInfo:
        """Commit a version; sent again with the same ``commit_key``, answers with the version it
        made. It releases what the save of that key held."""

    def resolve(self, run_id: str, ref: int | str = "latest") -> int:
        """The version number a reference names."""

    def manifest(self, run_id: str, ref: int | str = "latest") -> Manifest:
        """A version's manifest (IntegrityError if it no longer hashes to the digest it was committed with)."""

    def check_metadata(self, run_id: str, ref: int | str = "latest") -> list[MetadataProblem]:
        """What differs in a version's stored metadata from the digests covering it (empty: nothing)."""

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes are."""

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        """Read a byte range of a shard."""

    def read_scatter(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Read consecutive bytes of a shard from ``offset`` into ``buffers`` in turn (one request)."""

    def will_read(self, shard_id: str, spans: Sequence[tuple[int, int]]) -> None:
        """A hint that ``(offset, length)`` spans of a shard will be read soon; may do nothing."""

    def runs(self) -> list[RunInfo]:
        """Every run."""

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of a run."""

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Tag a version."""

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete a version."""

    def get_retention(self, run_id: str) -> RetentionPolicy:
        """A run's retention policy and what it would remove now."""

    def set_retention(
        self,
        run_id: str,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str | None = None,
        create_run: bool = False,
    ) -> RetentionPolicy:
        """Replace a run's retention policy (applied from the next commit); an unknown run is
        NotFoundError unless ``create_run``."""

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now the versions a run's policy does not keep."""

    def gc(
        self,
        *,
        grace_seconds: int | None = None,
        dry_run: bool = False,
        orphans: bool = False,
        compact_below: float | None = None,
        compress: bool = False,
        on_bytes: Callable[[int], object] | None = None,
    ) -> GcReport:
        """Sweep shards no version references (None: the default grace period), first compressing
        the tensors versions older than that added (``compress``; each one's raw bytes told to
        ``on_bytes`` where the work runs in this process) and compacting shards whose live bytes
        are below ``compact_below`` of their size."""

    def close(self) -> None:
        """Release resources."""
