"""What the store returns: plain pydantic records, serializable as JSON by the HTTP face."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ckptstore.service.format.names import MetricValue


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class ShardReceipt(_Record):
    """The outcome of ingesting one shard."""

    shard_id: str
    size: int
    tensors: int
    created: bool


class TensorsReceipt(_Record):
    """The outcome of storing tensors sent unhashed: the shard, and each tensor's digest in the order sent."""

    shard: ShardReceipt
    digests: list[str]


@dataclass(slots=True)
class TensorLocation:
    """Where one tensor digest's bytes live.

    A plain dataclass, not a pydantic model: a load of a model with tens of thousands of
    tensors builds one per tensor, and a model costs several times as much to build (a frozen
    dataclass three times as much as this one, 28 ms against 9 for 32,768). Treated as
    immutable all the same. The HTTP face still validates and serializes it as a JSON object.
    """

    digest: str
    shard_id: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    #: How the bytes at ``offset`` are stored (:mod:`service.format.encoding`): "raw" (``nbytes``
    #: of them), or an encoded payload of ``stored_nbytes`` bytes that decodes to ``nbytes``.
    encoding: str = "raw"
    stored_nbytes: int | None = None
    #: A delta's base: the digest whose raw bytes the decoded delta applies to.
    base: str | None = None

    @property
    def length(self) -> int:
        """How many bytes to read at ``offset``: the payload's, or the raw bytes'."""
        return self.nbytes if self.stored_nbytes is None else self.stored_nbytes

    @property
    def encoded(self) -> bool:
        """Whether the bytes stored are a payload to decode rather than the tensor's own."""
        return self.encoding != "raw"


class VersionInfo(_Record):
    """One committed version and its figures (bytes_new = bytes no earlier version referenced)."""

    run_id: str
    version: int
    parent: int | None
    created_at: datetime
    tags: list[str]
    step: int | None
    metrics: dict[str, MetricValue]
    tensors_total: int
    tensors_new: int
    bytes_total: int
    bytes_new: int
    bytes_trainable: int

    @property
    def dedup_ratio(self) -> float:
        """Share of the version's logical bytes that were already stored (0.0 to 1.0)."""
        return 1.0 - self.bytes_new / self.bytes_total if self.bytes_total else 0.0

    @classmethod
    def from_summary(cls, row: Sequence[Any], tags: list[str]) -> VersionInfo:
        """The version a row of the ``versions`` table's summary columns describes, in the order
        ``run_id, version, parent, created_at, step, metrics, tensors_total, tensors_new,
        bytes_total, bytes_new, bytes_trainable`` (:data:`service.catalog.listings.SUMMARY_COLUMNS`)."""
        run_id, version, parent, created_at, step, metrics, total, new, nbytes, bytes_new, trainable = row
        return cls(
            run_id=run_id,
            version=version,
            parent=parent,
            created_at=created_at,
            tags=tags,
            step=step,
            metrics=metrics or {},
            tensors_total=total,
            tensors_new=new,
            bytes_total=nbytes,
            bytes_new=bytes_new,
            bytes_trainable=trainable,
        )


def tags_by_version(rows: Iterable[Any]) -> dict[int, list[str]]:
    """``(version, tag)`` rows as each version's tags, sorted by name."""
    tags: dict[int, list[str]] = {}
    for version, name in rows:
        tags.setdefault(version, []).append(name)
    for names in tags.values():
        names.sort()
    return tags


class MetadataProblem(_Record):
    """One piece of a version's stored metadata that does not match what covers it.

    ``where`` names the piece (``part 12``, ``manifest``, a listed column such as ``step``);
    ``problem`` says what differs, in one line.
    """

    run_id: str
    version: int
    where: str
    problem: str


class RunInfo(_Record):
    """A run and its totals across versions."""

    run_id: str
    created_at: datetime
    updated_at: datetime
    versions: int
    latest_version: int | None
    bytes_total: int
    bytes_new: int


class RetentionPolicy(_Record):
    """A run's retention policy and the versions it would remove if applied now.

    A version is kept when any rule keeps it: it is one of the last ``keep_last`` versions, one
    of the ``keep_best`` best by ``metric`` (lowest for mode 'min', highest for 'max'), it is
    tagged, or it is the run's newest. Every other version is removed at the next commit.
    With neither ``keep_last`` nor ``keep_best`` set the run has no policy and keeps everything.
    """

    run_id: str
    keep_last: int | None
    keep_best: int | None
    metric: str | None
    mode: Literal["min", "max"] | None
    would_remove: list[int]


class GcReport(_Record):
    """What one garbage collection swept (or, on a dry run, would sweep) and what it kept.

    ``shards_in_grace`` are unreferenced but kept: recorded, or reported present to a client,
    within the grace period. ``orphan_blobs`` are blobs no shard row names (an interrupted
    collection, or an upload caught between storing and recording its shard); they are deleted
    only when asked, and ``orphans_swept`` counts those deleted. ``stale_uploads`` are
    incomplete S3 multipart uploads with nothing added within the grace period (a writer killed
    mid-upload), holding ``stale_upload_bytes`` in parts; asking for orphans aborts them too,
    and ``uploads_aborted`` counts those aborted. ``shards_compacted`` are shards whose live
    tensors were rewritten into a new shard (see :mod:`service.reclaim.compaction`); they are swept once
    the grace period has passed, freeing ``bytes_compacted``. A collection asked to compress
    (see :mod:`service.reclaim.compression`) visited ``versions_compressed`` versions and re-encoded
    ``tensors_compressed`` of their tensors (``tensors_as_deltas`` of them against the parent
    version's), whose ``bytes_before_compression`` raw bytes now take ``bytes_after_compression``;
    the shards they left are swept once the grace period has passed. Asking for orphans also
    removes the temporary files in the staging folders that no live process holds (left by a
    writer killed mid-save, see :mod:`service.reclaim.cleanup`): ``staging_files_swept`` of them,
    ``staging_bytes_swept`` in all.
    """

    dry_run: bool
    grace_seconds: int
    shards_swept: int
    tensors_swept: int
    bytes_swept: int
    shards_kept: int
    shards_in_grace: int
    orphan_blobs: int
    orphan_bytes: int
    orphans_swept: int
    stale_uploads: int = 0
    stale_upload_bytes: int = 0
    uploads_aborted: int = 0
    shards_compacted: int = 0
    bytes_compacted: int = 0
    versions_compressed: int = 0
    tensors_compressed: int = 0
    tensors_as_deltas: int = 0
    bytes_before_compression: int = 0
    bytes_after_compression: int = 0
    staging_files_swept: int = 0
    staging_bytes_swept: int = 0
    seconds: float
