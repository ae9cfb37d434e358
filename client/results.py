"""What save and load return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.service.format.records import RunInfo, VersionInfo


@dataclass(frozen=True)
class SaveResult:
    """The outcome of a save.

    ``bytes_total`` is the logical size of every tensor; ``bytes_new`` (and ``tensors_new``)
    what this save added to the store: the tensors no earlier version of any run referenced,
    the figures the version's record keeps (``ckptstore versions`` shows the same number);
    ``bytes_sent`` the tensor bytes the save sent, which may include bytes the store already
    had (a tensor changed since the last save goes unhashed, and the store keeps one copy);
    ``bytes_stored`` the shard bytes written, headers included.
    """

    run_id: str
    version: int
    bytes_total: int
    bytes_new: int
    bytes_stored: int
    tensors_total: int
    tensors_new: int
    shards: int
    seconds: float
    bytes_sent: int = 0

    @property
    def dedup_ratio(self) -> float:
        """Share of the logical bytes that did not have to be stored again."""
        return 1.0 - self.bytes_new / self.bytes_total if self.bytes_total else 0.0


@dataclass
class LoadResult:
    """The outcome of a load.

    ``state_dict`` holds the model tensors when no model was given (else None);
    ``casts`` lists every dtype conversion made, as ``"key: from -> to"``;
    ``rng_restored`` says whether the random number generators were set to the version's.
    """

    run_id: str
    version: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: Any = None
    state_dict: dict[str, torch.Tensor] | None = None
    casts: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    rng_restored: bool = False


__all__ = ["LoadResult", "RunInfo", "SaveResult", "VersionInfo"]
