"""What the store returns: plain pydantic records, serializable as JSON by the HTTP face."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class ShardReceipt(_Record):
    """The outcome of ingesting one shard."""

    shard_id: str
    size: int
    tensors: int
    created: bool


class TensorLocation(_Record):
    """Where one tensor digest's bytes live."""

    digest: str
    shard_id: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]


class VersionInfo(_Record):
    """One committed version and its figures (bytes_new = bytes no earlier version referenced)."""

    run_id: str
    version: int
    parent: int | None
    created_at: datetime
    tags: list[str]
    step: int | None
    metrics: dict[str, float]
    tensors_total: int
    tensors_new: int
    bytes_total: int
    bytes_new: int
    bytes_trainable: int

    @property
    def dedup_ratio(self) -> float:
        """Share of the version's logical bytes that were already stored (0.0 to 1.0)."""
        return 1.0 - self.bytes_new / self.bytes_total if self.bytes_total else 0.0


class RunInfo(_Record):
    """A run and its totals across versions."""

    run_id: str
    created_at: datetime
    updated_at: datetime
    versions: int
    latest_version: int | None
    bytes_total: int
    bytes_new: int
