"""What the compare page shows: several runs' metrics on shared charts (a line per run) and
their newest versions' hyperparameters side by side (no HTTP, no HTML).

Bounded whatever the runs' histories: at most :data:`MAX_RUNS` runs; per run one aggregate
statement (its span of versions) and one sample of at most :data:`runs.CHART_POINTS` versions
per chart, picked in the database as the run page picks them; and one manifest per run, its
newest version's, for the hyperparameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from ckptstore.service.api.pages.charts import Chart, Point, series_chart
from ckptstore.service.api.pages.formatting import full_json, reading_json
from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.api.pages.runs import (
    MAX_CHARTS,
    chart_sample,
    metric_points,
    metric_sample,
    sample_width,
)
from ckptstore.service.catalog import listings
from ckptstore.service.catalog.diff import hyperparameters
from ckptstore.service.catalog.listings import VersionFilter
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.names import validate_run_id
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

#: Runs one page compares at most (each has a colour of its own).
MAX_RUNS = 8
#: Hyperparameter rows shown at most.
MAX_VALUE_ROWS = 2000


def pick_runs(asked: list[str]) -> list[str]:
    """The runs to compare, in the order given, each once: 2 to :data:`MAX_RUNS`, else InvalidInputError."""
    chosen = list(dict.fromkeys(run.strip() for run in asked if run.strip()))
    if len(chosen) < 2:
        raise InvalidInputError(
            "pick at least two runs to compare: tick them on the runs page, or open /compare?run=a&run=b"
        )
    if len(chosen) > MAX_RUNS:
        raise InvalidInputError(
            f"{len(chosen)} runs were picked; a page compares at most {MAX_RUNS}: untick "
            f"{len(chosen) - MAX_RUNS} of them"
        )
    return [validate_run_id(run) for run in chosen]


@dataclass(frozen=True)
class ComparedRun:
    """One run on the compare page: its colour number, its newest version and how it was sampled."""

    run_id: str
    index: int
    latest: VersionInfo | None
    total: int
    shown: int

    @property
    def downsampled(self) -> bool:
        """True when the charts draw only some of its versions."""
        return self.shown < self.total


@dataclass(frozen=True)
class ValueRow:
    """A hyperparameter, metric or step of the newest versions: each run's value, read and in full."""

    path: str
    cells: list[tuple[str, str]]
    differs: bool


@dataclass(frozen=True)
class ComparePage:
    """Several runs: a chart per metric with a line per run, and their newest versions' values."""

    runs: list[ComparedRun]
    charts: list[Chart]
    left_out: list[str]
    rows: list[ValueRow]
    show_all: bool
    same: int
    hidden: int

    @property
    def downsampled(self) -> bool:
        """True when some run's charts draw a sample of its versions."""
        return any(run.downsampled for run in self.runs)

    def url(self, *, show_all: bool) -> str:
        """This comparison with or without the values every run shares."""
        query = [("run", run.run_id) for run in self.runs] + ([("all", "1")] if show_all else [])
        return "/compare?" + urlencode(query)


@dataclass(frozen=True)
class _Sampled:
    run_id: str
    span: tuple[int, int, int]
    sample: list[VersionInfo]


def _sample(store: Store, run_id: str) -> _Sampled | None:
    where = VersionFilter()
    total, lowest, highest = listings.version_span(db=store.db, run_id=run_id, where=where)
    if total == 0 or lowest is None or highest is None:
        return None
    width = sample_width(total, lowest, highest)
    return _Sampled(run_id, (total, lowest, highest), chart_sample(store, run_id, where, lowest, highest, width))


def _charts(store: Store, sampled: list[tuple[int, _Sampled]]) -> tuple[list[Chart], list[str]]:
    names = sorted({name for _, s in sampled for v in s.sample for name in v.metrics})
    charts = []
    for name in names[:MAX_CHARTS]:
        having = [
            (index, s, metric_sample(store, s.run_id, VersionFilter(), s.span, s.sample, name)) for index, s in sampled
        ]
        by_step = all(v.step is not None for _, _, versions in having for v in versions)
        series: list[tuple[str, int, list[Point]]] = [
            (s.run_id, index, metric_points(name, versions, by_step, prefix=f"{s.run_id} · "))
            for index, s, versions in having
            if versions
        ]
        charts.append(series_chart(name, series, "step" if by_step else "version"))
    return charts, names[MAX_CHARTS:]


def _value_rows(values: list[dict[str, Any]], show_all: bool) -> tuple[list[ValueRow], int]:
    rows, same = [], 0
    for path in sorted({path for flat in values for path in flat}):
        column = [flat.get(path) for flat in values]
        differs = len({json.dumps(value, sort_keys=True) for value in column}) > 1
        same += not differs
        if differs or show_all:
            fmt = NumberFormat.of(column)  # one row is one quantity: every run's value written alike
            rows.append(ValueRow(path, [(reading_json(value, fmt), full_json(value)) for value in column], differs))
    return rows, same


def compare_page(store: Store, run_ids: list[str], *, show_all: bool = False) -> ComparePage:
    """Compare ``run_ids`` (as :func:`pick_runs` returns them): charts and newest values.

    NotFoundError names a run that does not exist.
    """
    runs: list[ComparedRun] = []
    sampled: list[tuple[int, _Sampled]] = []
    values: list[dict[str, Any]] = []
    for index, run_id in enumerate(run_ids):
        found = _sample(store, run_id)
        latest = found.sample[-1] if found else None
        runs.append(
            ComparedRun(run_id, index, latest, found.span[0] if found else 0, len(found.sample) if found else 0)
        )
        if found:
            sampled.append((index, found))
        values.append(hyperparameters(store.manifest(run_id, latest.version)) if latest else {})
    charts, left_out = _charts(store, sampled)
    rows, same = _value_rows(values, show_all)
    return ComparePage(
        runs, charts, left_out, rows[:MAX_VALUE_ROWS], show_all, same, max(0, len(rows) - MAX_VALUE_ROWS)
    )
