"""What the runs index shows: every run (or those ``?q=`` finds), sorted, with store-wide totals.

A version's *new* bytes are those no version before it had stored, in any run; so a run's bytes
split into those *stored by this run* (the sum of its versions' new bytes) and those *shared*:
already in the store when its versions were saved, from its own earlier versions or from
other runs. The totals are the sums of the columns over every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.api.pages.runs import Order, metric_name, query_url, run_url
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

#: A run's main metric when the page names none: the first of these its newest version reports,
#: else the first of its metrics by name.
MAIN_METRICS = ("loss", "val_loss", "eval_loss", "train_loss")


@dataclass(frozen=True)
class RunRow:
    """One run on the index: its totals, its newest version, its tags and its main metric's value."""

    run_id: str
    versions: int
    latest: VersionInfo | None
    bytes_total: int
    bytes_new: int
    tags: list[tuple[str, int]]
    metric: str | None = None

    @property
    def url(self) -> str:
        """The run page."""
        return run_url(self.run_id)

    @property
    def bytes_shared(self) -> int:
        """Logical bytes that were already stored when this run's versions were saved."""
        return self.bytes_total - self.bytes_new

    @property
    def shared_share(self) -> float | None:
        """Shared bytes over logical bytes (None for a run of empty versions)."""
        return self.bytes_shared / self.bytes_total if self.bytes_total else None

    @property
    def metric_value(self) -> float | None:
        """The main metric at the newest version (None when it does not report it)."""
        if self.latest is None or self.metric is None:
            return None
        return self.latest.metrics.get(self.metric)


@dataclass(frozen=True)
class Totals:
    """Store-wide figures: the sums over every run."""

    runs: int
    versions: int
    bytes_total: int
    bytes_new: int

    @property
    def saving(self) -> float | None:
        """The share of logical bytes deduplication did not store."""
        return 1 - self.bytes_new / self.bytes_total if self.bytes_total else None


def _key(row: RunRow, column: str) -> Any:
    if column == "saved":
        return row.latest.created_at if row.latest else None
    if column == "metric":
        return row.metric_value
    return {
        "run": row.run_id,
        "versions": row.versions,
        "logical": row.bytes_total,
        "stored": row.bytes_new,
        "shared": row.bytes_shared,
    }[column]


#: Sortable columns of the index.
SORT_COLUMNS = ("run", "versions", "saved", "metric", "logical", "stored", "shared")


@dataclass(frozen=True)
class RunsIndex:
    """The index: the rows shown, in order, the totals over every run and what the page was asked."""

    rows: list[RunRow]
    totals: Totals
    q: str
    sort: str
    order: Order
    metric: str | None

    @cached_property
    def metric_format(self) -> NumberFormat:
        """One number format for the metric column, chosen from the values shown."""
        return NumberFormat.of(row.metric_value for row in self.rows)

    def url(self, *, sort: str | None = None, order: Order | None = None) -> str:
        """This page's URL with the sort changed (defaults left out)."""
        sort, order = sort or self.sort, order or self.order
        return query_url(
            "/",
            q=self.q or None,
            metric=self.metric,
            sort=None if sort == "saved" else sort,
            order=None if order == "desc" else order,
        )

    def sort_url(self, column: str) -> str:
        """Sort by ``column``: names ascending first, figures descending first, then toggling."""
        first: Order = "asc" if column == "run" else "desc"
        order: Order = ("desc" if self.order == "asc" else "asc") if column == self.sort else first
        return self.url(sort=column, order=order)


def main_metric(latest: VersionInfo | None, asked: str | None) -> str | None:
    """The metric the index shows for a run: ``asked``, else one of :data:`MAIN_METRICS`, else the first."""
    if asked is not None:
        return asked
    if latest is None or not latest.metrics:
        return None
    return next((name for name in MAIN_METRICS if name in latest.metrics), min(latest.metrics))


def _matches(q: str) -> Callable[[RunRow], bool]:
    needle = q.lower()
    return lambda row: needle in row.run_id.lower() or any(needle in tag.lower() for tag, _ in row.tags)


def runs_index(
    store: Store, *, q: str = "", sort: str = "saved", order: Order = "desc", metric: str | None = None
) -> RunsIndex:
    """Every run whose id or a tag contains ``q`` (ignoring case), sorted by ``sort``.

    A fixed number of statements, whatever the runs; versions without a value sort last.
    """
    if sort not in SORT_COLUMNS:
        raise InvalidInputError(f"cannot sort runs by {sort[:80]!r}: use one of {', '.join(SORT_COLUMNS)}")
    asked = None if not metric else metric_name(metric)
    rows = [
        RunRow(run.run_id, run.versions, latest, run.bytes_total, run.bytes_new, tags, main_metric(latest, asked))
        for run, latest, tags in store.runs_overview()
    ]
    totals = Totals(
        len(rows), sum(r.versions for r in rows), sum(r.bytes_total for r in rows), sum(r.bytes_new for r in rows)
    )
    q = q.strip()
    shown = [row for row in rows if _matches(q)(row)] if q else rows
    if sort != "saved" or order != "desc":  # the store lists runs most recently updated first
        present = [row for row in shown if _key(row, sort) is not None]
        absent = [row for row in shown if _key(row, sort) is None]
        present.sort(key=lambda row: row.run_id)  # ties stay in name order either way (sorts are stable)
        present.sort(key=lambda row: _key(row, sort), reverse=order == "desc")
        shown = present + absent
    return RunsIndex(shown, totals, q, sort, order, asked)
