"""SQLAlchemy 2.0 models of the metadata: shards, tensors, runs, versions, references, tags."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Table,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value.astimezone(timezone.utc) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    """Declarative base of every table."""


def table(model: type[Base]) -> Table:
    """The Core table of a mapped class, for statements built once and run on a connection."""
    return cast(Table, model.__table__)


class Shard(Base):
    """A stored safetensors shard, named by its id."""

    __tablename__ = "shards"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Tensor(Base):
    """Where the bytes of one tensor digest live: a shard and an absolute byte range."""

    __tablename__ = "tensors"
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    shard_id: Mapped[str] = mapped_column(ForeignKey("shards.id"), index=True)
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[list[int]] = mapped_column(JSON)
    offset: Mapped[int] = mapped_column(BigInteger)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    #: When a client was last told this tensor is present (it may commit a reference to it
    #: soon): garbage collection spares shards seen within its grace period.
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: How the bytes at ``offset`` are stored (:mod:`service.format.encoding`); None: raw, and
    #: ``nbytes`` of them. ``nbytes`` is always the raw length, ``stored_nbytes`` the payload's.
    encoding: Mapped[str | None] = mapped_column(String(24), nullable=True)
    stored_nbytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: The digest a delta's bytes are XORed with (a tensor of the same dtype and shape).
    base: Mapped[str | None] = mapped_column(String(64), nullable=True)

    # Whether any tensor of a size is stored (see Store.sizes_held) is one index probe.
    __table_args__ = (Index("ix_tensors_nbytes", "nbytes"),)


class TensorNeed(Base):
    """A digest that decoding tensor ``digest`` reads: its base, the base's base, and so on.

    Garbage collection keeps a tensor while any stored tensor needs it; the rows of a tensor go
    with its own row.
    """

    __tablename__ = "tensor_needs"
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    needs: Mapped[str] = mapped_column(String(64), primary_key=True)
    __table_args__ = (Index("ix_tensor_needs_needs", "needs"),)


class Run(Base):
    """A training run; ``version_counter`` hands out version numbers under a row lock."""

    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    version_counter: Mapped[int] = mapped_column(Integer, default=0)


class Version(Base):
    """A committed, immutable checkpoint version and its summary figures.

    ``manifest`` holds the manifest's head (every field but the tensor entries) and ``parts``
    the ids of the :class:`ManifestPart` rows holding its entries, in order.
    ``manifest_digest`` and ``figures_digest`` cover every byte a load or a listing trusts
    (``docs/FORMAT.md``, "Metadata digests"); ``ckptstore verify`` checks them.
    """

    __tablename__ = "versions"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    parent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    tensors_total: Mapped[int] = mapped_column(Integer)
    tensors_new: Mapped[int] = mapped_column(Integer)
    bytes_total: Mapped[int] = mapped_column(BigInteger)
    bytes_new: Mapped[int] = mapped_column(BigInteger)
    bytes_trainable: Mapped[int] = mapped_column(BigInteger)
    manifest: Mapped[str] = mapped_column(Text)
    parts: Mapped[list[int]] = mapped_column(JSON)
    #: Set once ``gc --compress`` has considered the tensors this version added.
    compressed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false(), index=True)
    #: The key the client named its commit by (``Idempotency-Key``): a commit sent again with
    #: the same key answers with this version instead of committing another.
    commit_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: BLAKE3 of the whole manifest text as loads read it (head and parts assembled): a load
    #: refuses a manifest that reads back otherwise. Empty only where a row was written without it.
    manifest_digest: Mapped[str] = mapped_column(String(64), server_default="")
    #: BLAKE3 of the figures the manifest cannot give (``tensors_new``, ``bytes_new``; see
    #: :func:`service.catalog.metadata_check.figures_digest`).
    figures_digest: Mapped[str] = mapped_column(String(64), server_default="")

    __table_args__ = (Index("ix_versions_commit_key", "run_id", "commit_key", unique=True),)


#: A part's id: SQLite hands out ids only to an INTEGER PRIMARY KEY (its rowid).
_PART_ID = BigInteger().with_variant(Integer, "sqlite")


def _part_key() -> ForeignKey:
    return ForeignKey("manifest_parts.id", ondelete="CASCADE")


class ManifestPart(Base):
    """A content-addressed group of manifest entries (see :mod:`service.format.parts`).

    ``versions`` counts the committed versions listing it: commits add to it and deletions
    take from it in their transactions, and garbage collection removes parts it counts none
    for. The body lives in :class:`PartBody`, so updating the count rewrites a short row.
    """

    __tablename__ = "manifest_parts"
    id: Mapped[int] = mapped_column(_PART_ID, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    versions: Mapped[int] = mapped_column(BigInteger)


class PartBody(Base):
    """The JSON text of a manifest part's entries."""

    __tablename__ = "part_bodies"
    part_id: Mapped[int] = mapped_column(_PART_ID, _part_key(), primary_key=True)
    entries: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)


class PartRef(Base):
    """One tensor digest a manifest part references (for dedup figures and garbage collection)."""

    __tablename__ = "part_refs"
    part_id: Mapped[int] = mapped_column(_PART_ID, _part_key(), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    __table_args__ = (Index("ix_part_refs_digest", "digest"),)


class Tag(Base):
    """A name pointing at one version of a run."""

    __tablename__ = "tags"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "version"], ["versions.run_id", "versions.version"], ondelete="CASCADE"),
    )


class RetentionPolicy(Base):
    """Which versions of a run to keep: the last N, the best K by a metric; tagged ones always."""

    __tablename__ = "retention_policies"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    keep_last: Mapped[int | None] = mapped_column(Integer, nullable=True)
    keep_best: Mapped[int | None] = mapped_column(Integer, nullable=True)
    metric: Mapped[str | None] = mapped_column(String(128), nullable=True)
    mode: Mapped[str | None] = mapped_column(String(3), nullable=True)  # "min" | "max"


class SaveLease(Base):
    """A save in progress, named by its commit key: alive while its last call was within the lease
    (:mod:`service.db.holds`); its commit, or garbage collection once it lapsed, removes it."""

    __tablename__ = "save_leases"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class SaveHold(Base):
    """A digest a save in progress was told is present, or stored: garbage collection keeps its
    tensor while the save's lease is alive."""

    __tablename__ = "save_holds"
    save_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    __table_args__ = (Index("ix_save_holds_digest", "digest"),)


class StoreLock(Base):
    """Named rows locked to keep garbage collection and commits from interleaving."""

    __tablename__ = "store_locks"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
