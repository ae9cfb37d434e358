"""How many raw bytes a compressing collection will visit, counted before it starts, for a
progress bar with a total and an estimate of the time left.

The count mirrors what :func:`service.reclaim.compression.compress` visits: in every committed
version older than the cutoff and not yet visited, the manifest parts its parent lacks; in them,
the tensors still stored raw of at least :data:`~service.reclaim.compression.MIN_BYTES`, each
counted once however many runs and versions hold it. It reads part references and tensor rows,
never a manifest's text. A tensor a pass leaves raw and meets again in another run is visited
twice and counted once, so a bar may pass its total by that much.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Protocol, runtime_checkable

from sqlalchemy import func, select

from ckptstore.service.catalog import lookup
from ckptstore.service.db import Database
from ckptstore.service.db.models import PartRef, Tensor, Version

#: Part ids per query.
PART_BATCH = 500


@runtime_checkable
class ExpectsTotal(Protocol):
    """What a compressing collection's ``on_bytes`` may also be: told the total first."""

    def __call__(self, nbytes: int) -> object:
        """Told the raw bytes of each tensor visited, as it is done."""

    def expect(self, total: int) -> object:
        """Told, before the first tensor, the raw bytes the pass will visit (:func:`pending_bytes`)."""


def pending_bytes(db: Database, cutoff: datetime, min_bytes: int) -> int:
    """Raw bytes of the distinct tensors of at least ``min_bytes`` that the parts added by versions
    committed before ``cutoff`` and not yet compressed hold (see the module docstring)."""
    with db.transaction() as session:
        rows = session.execute(
            select(Version.run_id, Version.version, Version.parent, Version.parts).where(
                ~Version.compressed, Version.created_at < cutoff
            )
        ).all()
        parents = {(run_id, parent) for run_id, _, parent, _ in rows if parent is not None}
        parent_parts: dict[tuple[str, int], list[int]] = {}
        for run_id, version in parents:
            parts = session.scalar(select(Version.parts).where(Version.run_id == run_id, Version.version == version))
            parent_parts[(run_id, version)] = [int(p) for p in parts or ()]
        added: set[int] = set()
        for run_id, _, parent, parts in rows:
            theirs = set(parent_parts.get((run_id, parent), ())) if parent is not None else set()
            added.update(int(p) for p in parts if int(p) not in theirs)
        digests: set[str] = set()
        ordered = sorted(added)
        for start in range(0, len(ordered), PART_BATCH):
            batch = ordered[start : start + PART_BATCH]
            digests.update(session.scalars(select(PartRef.digest).where(PartRef.part_id.in_(batch))))
        total = 0
        for batch_digests in lookup.batches(sorted(digests)):
            total += (
                session.scalar(
                    select(func.coalesce(func.sum(Tensor.nbytes), 0)).where(
                        Tensor.digest.in_(batch_digests), Tensor.encoding.is_(None), Tensor.nbytes >= min_bytes
                    )
                )
                or 0
            )
    return int(total)


def tell_total(db: Database, cutoff: datetime, min_bytes: int, on_bytes: Callable[[int], object] | None) -> None:
    """Tell ``on_bytes`` the total first, when it is an :class:`ExpectsTotal`."""
    if isinstance(on_bytes, ExpectsTotal):
        on_bytes.expect(pending_bytes(db, cutoff, min_bytes))


__all__ = ["ExpectsTotal", "pending_bytes", "tell_total"]
