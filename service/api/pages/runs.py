"""What the runs index and a run's page show, shaped from the store's listings (no HTTP, no HTML).

The run page reads what it shows and no more: one aggregate statement counts the versions the
filter keeps, one reads the page of them in the order asked for, and the charts read a sample of
at most :data:`CHART_POINTS` versions per chart (picked in the database), so a run of 100,000
versions draws from as many rows as one of 300. Only a run with an active retention policy
reads every version's metrics, to say why each one is kept.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal
from urllib.parse import quote, urlencode

from ckptstore.service.api.pages.charts import Chart, Point, line_chart, storage_chart
from ckptstore.service.api.pages.model_share import model_bytes, trainable_share
from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.catalog import listings
from ckptstore.service.catalog.listings import VersionFilter
from ckptstore.service.catalog.retention_rules import Policy, keep_reasons
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.names import METRIC_PATTERN, validate_run_id
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

Order = Literal["asc", "desc"]
#: Sortable columns of the run page besides ``metric:<name>``, and the listing column of each.
SORT_COLUMNS = {"version": "version", "step": "step", "logical": "bytes_total", "stored": "bytes_new"}
_METRIC = re.compile(METRIC_PATTERN)
_METRIC_SORT = re.compile("^metric:" + METRIC_PATTERN.removeprefix("^"))
_TAG_GLOB = re.compile(r"^[A-Za-z0-9._*?-]{1,64}$")
#: Versions on a page of the run page unless ``per_page`` says otherwise.
PER_PAGE = 50
#: Points a chart draws at most (one more: the newest version is always drawn).
CHART_POINTS = 300
#: Metrics charted at most; the page names the rest.
MAX_CHARTS = 12


def query_url(path: str, **query: object) -> str:
    """``path`` with the query parameters that are not None."""
    params = {k: v for k, v in query.items() if v is not None}
    return path + ("?" + urlencode(params) if params else "")


def run_url(run_id: str) -> str:
    """The run page's path (run ids are validated, quoting is belt and braces)."""
    return f"/runs/{quote(run_id, safe='')}"


def version_url(run_id: str, ref: int | str) -> str:
    """A version page's path."""
    return f"{run_url(run_id)}/versions/{quote(str(ref), safe='')}"


def plural(count: int, noun: str) -> str:
    """'1 version', '3 versions', '1,000 versions'."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


# -- filters -------------------------------------------------------------------------------------


def metric_name(text: str, what: str = "metric") -> str:
    """``text`` if it can name a metric, else InvalidInputError naming the problem."""
    if not _METRIC.fullmatch(text):
        raise InvalidInputError(
            f"{what} {text[:80]!r} cannot name a metric: use letters, digits and _ . / : - (e.g. loss)"
        )
    return text


def _bound(text: str | None, name: str) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a finite number such as 0.5, not {text[:40]!r}")
    return value


@dataclass(frozen=True)
class RunFilter:
    """The run page's filter: versions with a tag matching ``tag`` (a glob) and ``metric`` in range."""

    tag: str | None = None
    metric: str | None = None
    low: float | None = None
    high: float | None = None

    @classmethod
    def parse(cls, tag: str | None, metric: str | None, low: str | None, high: str | None) -> RunFilter:
        """The filter the query parameters ask for (empty fields, as a form sends them, are absent)."""
        tag = tag.strip() if tag and tag.strip() else None
        metric = metric.strip() if metric and metric.strip() else None
        if tag is not None and not _TAG_GLOB.fullmatch(tag):
            raise InvalidInputError(
                f"tag filter {tag[:80]!r} may hold letters, digits, '.', '_', '-' and the wildcards * and ?"
            )
        lowest, highest = _bound(low, "min"), _bound(high, "max")
        if metric is None and (lowest is not None or highest is not None):
            raise InvalidInputError("min and max need a metric to compare: add &metric=loss (or another metric)")
        if lowest is not None and highest is not None and lowest > highest:
            raise InvalidInputError(f"min ({lowest:g}) is above max ({highest:g}): no version can match")
        return cls(tag, None if metric is None else metric_name(metric), lowest, highest)

    @property
    def active(self) -> bool:
        """True when the filter leaves versions out."""
        return self.tag is not None or self.metric is not None

    def where(self) -> VersionFilter:
        """The listing filter."""
        return VersionFilter(tag=self.tag, metric=self.metric, low=self.low, high=self.high)

    @staticmethod
    def text(value: float | None) -> str | None:
        """A bound as typed back into the form: exact, and '1' rather than '1.0'."""
        if value is None:
            return None
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)

    def query(self) -> dict[str, str | None]:
        """The filter as query parameters."""
        return {"tag": self.tag, "metric": self.metric, "min": self.text(self.low), "max": self.text(self.high)}

    def describe(self) -> str:
        """The filter in words: "tagged 'release*', loss from 0.1 to 2"."""
        parts = [] if self.tag is None else [f"tagged {self.tag!r}"]
        if self.metric is not None:
            if self.low is not None and self.high is not None:
                parts.append(f"{self.metric} from {self.low:g} to {self.high:g}")
            elif self.low is not None:
                parts.append(f"{self.metric} at least {self.low:g}")
            elif self.high is not None:
                parts.append(f"{self.metric} at most {self.high:g}")
            else:
                parts.append(f"reporting {self.metric}")
        return ", ".join(parts)


# -- the run page -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionView:
    """A run's retention policy and, for every version, the rules keeping it (none: removed next commit)."""

    policy: Policy
    reasons: dict[int, list[str]]

    @property
    def would_remove(self) -> list[int]:
        """The versions the next commit removes, as the run stands."""
        return [version for version, why in self.reasons.items() if not why] if self.policy.active else []

    def label(self, version: int) -> str:
        """Why ``version`` is kept ('last 3, tagged'), or that the next commit removes it."""
        why = self.reasons.get(version, ["newest"])
        if not why:
            return "removed at the next commit"
        names = {
            "last": f"last {self.policy.keep_last}",
            "best": f"best {self.policy.keep_best} by {self.policy.metric}",
        }
        return "kept: " + ", ".join(names.get(reason, reason) for reason in why)


@dataclass(frozen=True)
class RunCharts:
    """The run page's charts: one per metric and the storage per version, and how they were sampled.

    ``width`` is the run of version numbers each point stands for (1: every version has its
    point); ``shown`` the versions in the storage chart, of ``total`` the filter keeps.
    """

    metrics: list[Chart] = field(default_factory=list)
    storage: Chart | None = None
    total: int = 0
    shown: int = 0
    width: int = 1
    left_out: list[str] = field(default_factory=list)

    @property
    def downsampled(self) -> bool:
        """True when some versions have no point."""
        return self.shown < self.total


@dataclass(frozen=True)
class RunPage:
    """One page of a run's versions, sorted over all of them before paginating, and its charts."""

    run_id: str
    rows: list[VersionInfo]
    metric_names: list[str]
    total: int
    page: int
    pages: int
    per_page: int
    sort: str
    order: Order
    retention: RetentionView | None = None
    filter: RunFilter = RunFilter()
    charts: RunCharts = RunCharts()
    all_metrics: list[str] = field(default_factory=list)
    #: Each listed version's model bytes (see :mod:`service.api.pages.model_share`).
    model_bytes: dict[int, int] = field(default_factory=dict)

    def trainable_share(self, info: VersionInfo) -> float | None:
        """``info``'s trainable bytes over its model's bytes (None with no model tensors)."""
        return trainable_share(info.bytes_trainable, self.model_bytes.get(info.version, 0))

    @cached_property
    def formats(self) -> dict[str, NumberFormat]:
        """One number format per metric column, chosen from the values the page shows."""
        return {name: NumberFormat.of(v.metrics.get(name) for v in self.rows) for name in self.metric_names}

    def url(self, *, page: int | None = None, sort: str | None = None, order: Order | None = None) -> str:
        """This page's URL with some parameters changed (defaults left out)."""
        page, sort, order = page or self.page, sort or self.sort, order or self.order
        return query_url(
            run_url(self.run_id),
            **self.filter.query(),
            page=page if page != 1 else None,
            per_page=self.per_page if self.per_page != PER_PAGE else None,
            sort=sort if sort != "version" else None,
            order=order if order != "desc" else None,
        )

    def sort_url(self, column: str) -> str:
        """Sort by ``column`` from page 1: ascending first, then toggling."""
        order: Order = ("desc" if self.order == "asc" else "asc") if column == self.sort else "asc"
        return self.url(page=1, sort=column, order=order)

    def page_links(self) -> list[int | None]:
        """Page numbers to link: the first, the last and two either side of this one (None = a gap).

        A gap of a single page shows that page instead: '1 2 3' reads better than '1 … 3'.
        """
        wanted = sorted({1, self.pages, *range(max(1, self.page - 2), min(self.pages, self.page + 2) + 1)})
        links: list[int | None] = []
        previous = 0
        for number in wanted:
            if number - previous == 2:
                links.append(previous + 1)
            elif previous and number - previous > 2:
                links.append(None)
            links.append(number)
            previous = number
        return links


def sort_key(sort: str) -> tuple[str, str | None]:
    """(listing column, metric name) of a run page ``sort`` ('version', 'step', 'metric:loss', …)."""
    if sort in SORT_COLUMNS:
        return SORT_COLUMNS[sort], None
    if _METRIC_SORT.fullmatch(sort):
        return "version", sort.removeprefix("metric:")
    raise InvalidInputError(
        f"cannot sort by {sort[:80]!r}: use one of {', '.join(SORT_COLUMNS)} or metric:<name>, e.g. metric:loss"
    )


def retention_view(store: Store, run_id: str) -> RetentionView:
    """The run's policy and why each version is kept (every version is read only under an active policy)."""
    policy = Policy.of(store.get_retention(run_id))
    if not policy.active:
        return RetentionView(policy, {})
    versions = store.versions(run_id)
    tagged = {v.version for v in versions if v.tags}
    reasons = keep_reasons(policy, {v.version: v.metrics for v in versions}, tagged)
    return RetentionView(policy, {number: list(why) for number, why in reasons.items()})


def metric_points(name: str, versions: list[VersionInfo], by_step: bool, prefix: str = "") -> list[Point]:
    """The points of metric ``name`` over step (or version): (x, value, version, hover text), the
    values in one format; ``prefix`` starts each hover text (a run's id on the compare page)."""
    having = [v for v in versions if name in v.metrics]
    fmt = NumberFormat.of(v.metrics[name] for v in having)
    return [
        (
            float(v.step if by_step and v.step is not None else v.version),
            v.metrics[name],
            v.version,
            f"{prefix}v{v.version}"
            + (f" · step {v.step:,}" if v.step is not None else "")
            + f" · {name} {fmt(v.metrics[name])}",
        )
        for v in having
    ]


def _metric_chart(name: str, versions: list[VersionInfo]) -> Chart:
    by_step = all(v.step is not None for v in versions)
    return line_chart(name, metric_points(name, versions, by_step), "step" if by_step else "version")


def sample_width(total: int, lowest: int, highest: int) -> int:
    """The run of version numbers each chart point stands for: 1 up to :data:`CHART_POINTS` versions."""
    return 1 if total <= CHART_POINTS else math.ceil((highest - lowest + 1) / CHART_POINTS)


def chart_sample(
    store: Store, run_id: str, where: VersionFilter, lowest: int, highest: int, width: int
) -> list[VersionInfo]:
    """The versions the charts draw, oldest first: all of them (up to :data:`CHART_POINTS` + 1),
    or one per run of ``width`` version numbers and the newest, picked in the database."""
    if width == 1:
        return listings.sorted_versions(
            db=store.db, run_id=run_id, where=where, descending=False, limit=CHART_POINTS + 1
        )
    return listings.sampled_versions(
        db=store.db, run_id=run_id, where=where, lowest=lowest, highest=highest, width=width
    )


def metric_sample(
    store: Store, run_id: str, where: VersionFilter, span: tuple[int, int, int], sample: list[VersionInfo], name: str
) -> list[VersionInfo]:
    """The versions of ``sample`` reporting ``name``; for a downsampled run whose sample misses
    some, a sample of the versions that report it (bounded the same way)."""
    total, lowest, highest = span
    width = sample_width(total, lowest, highest)
    having = [v for v in sample if name in v.metrics]
    if width > 1 and len(having) < len(sample):  # a sparse metric: sample the versions that report it
        having = chart_sample(store, run_id, replace(where, having=name), lowest, highest, width)
    return having


def run_charts(
    store: Store, run_id: str, where: VersionFilter, span: tuple[int, int | None, int | None], rows: list[VersionInfo]
) -> RunCharts:
    """A chart per metric (of the sample and the page's ``rows``) and the storage chart, from a bounded sample."""
    total, lowest, highest = span
    if total == 0 or lowest is None or highest is None:
        return RunCharts()
    width = sample_width(total, lowest, highest)
    sample = chart_sample(store, run_id, where, lowest, highest, width)
    names = sorted({name for v in (*sample, *rows) for name in v.metrics})
    bounds = (total, lowest, highest)
    charts = [
        _metric_chart(name, metric_sample(store, run_id, where, bounds, sample, name)) for name in names[:MAX_CHARTS]
    ]
    storage = storage_chart("storage per version", [(v.version, v.bytes_new, v.bytes_total) for v in sample])
    return RunCharts(charts, storage, total, len(sample), width, names[MAX_CHARTS:])


def run_page(
    store: Store,
    run_id: str,
    *,
    page: int = 1,
    per_page: int = PER_PAGE,
    sort: str = "version",
    order: Order = "desc",
    filter: RunFilter | None = None,  # noqa: A002 - the page's word for it
) -> RunPage:
    """Page ``page`` of the versions of ``run_id`` that ``filter`` keeps, sorted by ``sort``, with charts."""
    run_id = validate_run_id(run_id)
    chosen = filter or RunFilter()
    column, metric = sort_key(sort)
    where = chosen.where()
    span = listings.version_span(db=store.db, run_id=run_id, where=where)
    total = span[0]
    pages = max(1, math.ceil(total / per_page))
    if page > pages:
        matching = " matching the filter" if chosen.active else ""
        raise NotFoundError(
            f"run {run_id!r} has {plural(total, 'version')}{matching}, "
            f"{plural(pages, 'page')} of {per_page}; there is no page {page}"
        )
    rows = listings.sorted_versions(
        db=store.db,
        run_id=run_id,
        where=where,
        sort=column,
        metric=metric,
        descending=order == "desc",
        offset=(page - 1) * per_page,
        limit=per_page,
    )
    charts = run_charts(store, run_id, where, span, rows)
    names = sorted({name for v in rows for name in v.metrics})
    known = sorted({*names, *(c.title for c in charts.metrics), *charts.left_out, *filter_metric(chosen)})
    view = retention_view(store, run_id)
    models = {v.version: model_bytes(store, v) for v in rows}
    return RunPage(run_id, rows, names, total, page, pages, per_page, sort, order, view, chosen, charts, known, models)


def filter_metric(chosen: RunFilter) -> list[str]:
    """The filter's metric, as a list of none or one name."""
    return [] if chosen.metric is None else [chosen.metric]
