"""Listings read summary columns only: versions, one version, and every run's newest version.

Each test records the SQL the store sends (a real SQLite file and a real PostgreSQL database)
and checks what a listing reads and how many statements it takes, besides what it returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from shardkit import Ingest, body, entry, raw
from sqlalchemy import event

from ckptstore.service.errors import NotFoundError
from ckptstore.service.store import Store

RUN = "run-1"


@contextmanager
def statements(store: Store) -> Iterator[list[str]]:
    """Every SQL statement ``store`` sends inside the block."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(store.db.engine, "before_cursor_execute", record)


def reads_manifests(sent: list[str]) -> bool:
    """Whether any statement reads a manifest's text or any part of one."""
    return any("versions.manifest" in s or "manifest_parts" in s for s in sent)


def test_versions_list_summaries_without_reading_a_manifest(store: Store, ingest: Ingest) -> None:
    w = raw("F32", (4,), 1)
    ingest(w)
    for step in range(3):
        store.commit(RUN, body(entry("model/w", w), step=step, metrics={"loss": 1.0 / (step + 1)}), tags=[f"t{step}"])
    store.tag(RUN, 2, "best")

    with statements(store) as sent:
        listed = store.versions(RUN)

    assert [(v.version, v.step, v.tags, v.metrics["loss"]) for v in listed] == [
        (1, 0, ["t0"], 1.0),
        (2, 1, ["best", "t1"], 0.5),
        (3, 2, ["t2"], 1.0 / 3),
    ]
    assert [v.parent for v in listed] == [None, 1, 2]
    assert listed[0].tensors_total == 1 and listed[0].bytes_total == w.nbytes
    assert sent and not reads_manifests(sent)


def test_one_version_is_read_directly(store: Store, ingest: Ingest) -> None:
    w = raw("F32", (4,), 1)
    ingest(w)
    for step in range(5):
        store.commit(RUN, body(entry("model/w", w), step=step))
    store.tag(RUN, 4, "best")

    with statements(store) as sent:
        info = store.version(RUN, "best")

    assert (info.version, info.step, info.tags) == (4, 3, ["best"])
    assert info == store.versions(RUN)[3]
    assert store.version(RUN).version == 5
    assert not reads_manifests(sent)
    assert len(sent) < 10  # not one per version
    with pytest.raises(NotFoundError, match="no version 9"):
        store.version(RUN, 9)


def test_the_runs_overview_takes_the_same_statements_for_any_number_of_runs(store: Store, ingest: Ingest) -> None:
    w = raw("F32", (4,), 1)
    ingest(w)

    def add_runs(start: int, count: int) -> None:
        for index in range(start, start + count):
            for step in range(2):
                store.commit(f"run-{index}", body(entry("model/w", w), step=step), tags=["first"] if not step else [])

    add_runs(0, 2)
    with statements(store) as few:
        small = store.runs_overview()
    add_runs(2, 20)
    store.commit("empty-later", body(entry("model/w", w)))
    store.delete_version("empty-later", 1)
    with statements(store) as many:
        large = store.runs_overview()

    assert len(few) == len(many)
    assert not reads_manifests(many)
    assert len(small) == 2 and len(large) == 23
    by_run = {run.run_id: (latest, tags) for run, latest, tags in large}
    latest, tags = by_run["run-7"]
    assert latest is not None and (latest.version, latest.step, latest.tags) == (2, 1, [])
    assert tags == [("first", 1)]
    assert by_run["empty-later"] == (None, [])
