"""NaN and infinite metrics in the metadata database, alike on SQLite and PostgreSQL: stored as
"NaN", "Infinity", "-Infinity" in the metrics column (PostgreSQL's JSON refuses a bare NaN), read
back as floats, left out of metric ranges and sorted after every finite value, and consistent
with the manifest for the metadata check."""

from __future__ import annotations

import math

from sqlalchemy import select

from ckptstore.service.catalog.listings import VersionFilter, sorted_versions
from ckptstore.service.db.models import Version
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.store import Store

LOSSES = [0.5, math.nan, 0.25, math.inf, -math.inf, 0.125]


def losses(versions: list) -> list[tuple[int, str]]:  # type: ignore[type-arg]
    """(version, loss as repr) of each listed version."""
    return [(v.version, repr(v.metrics.get("loss"))) for v in versions]


def test_non_finite_metrics_are_stored_listed_sorted_and_checked(store: Store) -> None:
    for step, loss in enumerate(LOSSES, start=1):
        store.commit("diverged", ManifestBody(tensors=[], step=step, metrics={"loss": loss, "lr": 0.1}))
    with store.db.transaction() as session:
        column = dict(session.execute(select(Version.version, Version.metrics)).all())
    assert [column[v]["loss"] for v in range(1, 7)] == [0.5, "NaN", 0.25, "Infinity", "-Infinity", 0.125]

    listed = store.versions("diverged")
    assert losses(listed) == [(1, "0.5"), (2, "nan"), (3, "0.25"), (4, "inf"), (5, "-inf"), (6, "0.125")]
    assert repr(store.version("diverged", 2).metrics["loss"]) == "nan"
    ((_, latest, _),) = store.runs_overview()
    assert latest is not None and latest.metrics["loss"] == 0.125
    assert math.isnan(store.manifest("diverged", 2).metrics["loss"])

    def kept(where: VersionFilter, **order: object) -> list[int]:
        return [v.version for v in sorted_versions(db=store.db, run_id="diverged", where=where, **order)]  # type: ignore[arg-type]

    assert kept(VersionFilter(metric="loss", low=0.0)) == [6, 3, 1]
    assert kept(VersionFilter(metric="loss", high=0.3)) == [6, 3]
    assert kept(VersionFilter(having="loss")) == [6, 5, 4, 3, 2, 1]  # NaN is reported, so kept
    # Finite values in order, then the ones without a comparable value, newest first.
    assert kept(VersionFilter(), metric="loss", descending=False) == [6, 3, 1, 5, 4, 2]
    assert kept(VersionFilter(), metric="loss", descending=True) == [1, 3, 6, 5, 4, 2]
    for version in range(1, 7):
        assert store.check_metadata("diverged", version) == []
