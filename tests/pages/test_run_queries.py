"""The run page's listings (service.catalog.listings): filtered counts, sorted pages and bounded samples,
the same on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.catalog.listings import (
    VersionFilter,
    like_pattern,
    sampled_versions,
    sorted_versions,
    version_span,
)
from ckptstore.service.db import Database, schema
from ckptstore.service.errors import NotFoundError
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.store import Store
from tests.pages.kit import LONG, LONG_VERSIONS, entry, ingest, long_loss, raw, seed


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """The page tests' store (runs alpha and lora-sweep) and run 'gaps', on each database."""
    home = tmp_path_factory.mktemp(request.param)
    if request.param == "sqlite":
        store = Store.open_home(home / "home")
    else:
        databases = request.getfixturevalue("postgres_databases")
        database = Database(databases.create())
        schema.upgrade(database)
        store = Store(database, LocalBlobStore(home / "blobs"), home / "staging")
    try:
        seed(store)
        add_gaps(store)
        yield store
    finally:
        store.close()


GAPS = {1: (10, 3.0), 2: (None, 1.0), 3: (30, None), 4: (40, 1.0)}


def add_gaps(store: Store) -> None:
    """Run 'gaps': version 2 has no step, version 3 no loss, versions 2 and 4 tie on loss."""
    tensor = raw(4242, (2,))
    ingest(store, tensor)
    for step, loss in GAPS.values():
        metrics = {} if loss is None else {"loss": loss}
        store.commit(
            "gaps", ManifestBody(tensors=[entry("model/w", tensor, trainable=True)], step=step, metrics=metrics)
        )


def order(store: Store, **how: Any) -> list[int]:
    return [v.version for v in sorted_versions(db=store.db, run_id="gaps", where=VersionFilter(), **how)]


def test_sorting_puts_missing_values_last_in_either_order(seeded: Store) -> None:
    assert order(seeded, metric="loss", descending=False) == [2, 4, 1, 3]  # ties by version
    assert order(seeded, metric="loss", descending=True) == [1, 4, 2, 3]
    assert order(seeded, sort="step", descending=False) == [1, 3, 4, 2]
    assert order(seeded, sort="step", descending=True) == [4, 3, 1, 2]
    assert order(seeded, sort="version") == [4, 3, 2, 1]
    assert order(seeded, sort="version", offset=1, limit=2) == [3, 2]


def span(store: Store, **where: Any) -> tuple[int, int | None, int | None]:
    return version_span(db=store.db, run_id=LONG, where=VersionFilter(**where))


def test_filters_count_in_the_database(seeded: Store) -> None:
    assert span(seeded) == (LONG_VERSIONS, 1, LONG_VERSIONS)
    assert span(seeded, tag="*") == (2, 100, 120)
    assert span(seeded, tag="RELEASE-?") == (1, 100, 100)  # case is ignored, ? is one character
    assert span(seeded, tag="release_1") == (0, None, None)  # '_' is a character, not LIKE's wildcard
    in_range = [v for v in range(1, LONG_VERSIONS + 1) if 1 <= long_loss(v) <= 2]
    assert span(seeded, metric="loss", low=1, high=2) == (len(in_range), min(in_range), max(in_range))
    assert span(seeded, metric="val_loss") == (12, 10, 120)
    assert span(seeded, metric="val_loss", high=3) == (3, 100, 120)
    assert span(seeded, having="nope") == (0, None, None)
    with pytest.raises(NotFoundError, match="run 'nope' does not exist"):
        version_span(db=seeded.db, run_id="nope", where=VersionFilter())


def test_like_patterns_escape_what_like_would_read() -> None:
    assert like_pattern("Best_*") == "best\\_%"
    assert like_pattern("a%b?") == "a\\%b_"


def sample(store: Store, width: int, **where: Any) -> list[int]:
    found = sampled_versions(
        db=store.db, run_id=LONG, where=VersionFilter(**where), lowest=1, highest=LONG_VERSIONS, width=width
    )
    return [v.version for v in found]


def test_a_sample_takes_the_first_version_of_each_run_of_numbers_and_the_newest(seeded: Store) -> None:
    assert sample(seeded, 5) == [*range(1, 120, 5), 120]
    assert sample(seeded, 50) == [1, 51, 101, 120]
    assert sample(seeded, 1) == list(range(1, 121))
    assert sample(seeded, 7, having="val_loss") == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120]
    assert sample(seeded, 30, tag="*") == [100, 120]


def test_each_pick_of_a_sample_is_an_index_search_not_a_scan(tmp_path: Path) -> None:
    """SQLite's plan for the sample: every read of the versions table searches its primary key
    for one run of numbers (or the newest), so the rows read do not grow with the run's history."""
    store = Store.open_home(tmp_path / "home")
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        statements.append((statement, parameters))

    event.listen(store.db.engine, "before_cursor_execute", capture)
    try:
        sampled_versions(db=store.db, run_id="x", where=VersionFilter(), lowest=1, highest=100_000, width=333)
        statement, parameters = next((s, p) for s, p in statements if "buckets" in s)
        with store.db.engine.connect() as connection:
            plan = [row[3] for row in connection.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
    finally:
        store.close()
    reads = [step for step in plan if "versions" in step or " picked" in step or " newest" in step]
    assert len(reads) == 3 and all(step.startswith("SEARCH") for step in reads), plan
    assert any("(run_id=? AND version>? AND version<?)" in step for step in reads), plan
