"""What the HTML pages show, shaped from the store's records (no HTTP, no HTML, no torch).

Each ``*_page`` function reads what one page needs through the public :class:`Store` methods
and returns a plain dataclass the template walks; the formatting helpers at the bottom are the
template filters. Nothing here escapes text: the templates autoescape every value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal
from urllib.parse import quote, urlencode

from service.api.streaming import PIECE_BYTES
from service.diff import TensorChange, VersionDiff, diff_manifests
from service.errors import InvalidInputError, NotFoundError
from service.format.manifest import Manifest, TensorEntry
from service.format.names import METRIC_PATTERN, parse_ref
from service.records import VersionInfo
from service.retention_rules import Policy, keep_reasons
from service.store import Store

Order = Literal["asc", "desc"]
#: Sortable columns of the run page besides ``metric:<name>``, and what they sort by.
SORT_COLUMNS = {
    "version": lambda v: v.version,
    "step": lambda v: v.step,
    "logical": lambda v: v.bytes_total,
    "stored": lambda v: v.bytes_new,
}
_METRIC_SORT = re.compile("^metric:" + METRIC_PATTERN.removeprefix("^"))
#: Sections of a version page: (title, key prefix); the first matching prefix wins.
SECTIONS = (
    ("Model", "model/"),
    ("Optimizer state", "optim/state/"),
    ("Param groups", "optim/param_groups/"),
    ("Optimizer state", "optim/"),
    ("Scheduler", "scheduler/"),
    ("Extra", "extra/"),
)
#: Versions on a page of the run page unless ``per_page`` says otherwise.
PER_PAGE = 50
#: Rows one table shows at most; a page of a million tensors would be too big to be useful.
MAX_ROWS = 5000


def _url(path: str, **query: object) -> str:
    params = {k: v for k, v in query.items() if v is not None}
    return path + ("?" + urlencode(params) if params else "")


def run_url(run_id: str) -> str:
    """The run page's path (run ids are validated, quoting is belt and braces)."""
    return f"/runs/{quote(run_id, safe='')}"


def version_url(run_id: str, ref: int | str) -> str:
    """A version page's path."""
    return f"{run_url(run_id)}/versions/{quote(str(ref), safe='')}"


# -- the runs index -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRow:
    """One run on the index: its totals, its newest version and the tags pointing into it."""

    run_id: str
    versions: int
    latest: VersionInfo | None
    bytes_total: int
    bytes_new: int
    tags: list[tuple[str, int]]

    @property
    def url(self) -> str:
        """The run page."""
        return run_url(self.run_id)


def runs_index(store: Store) -> list[RunRow]:
    """Every run, most recently updated first (a fixed number of statements, whatever the runs)."""
    return [
        RunRow(run.run_id, run.versions, latest, run.bytes_total, run.bytes_new, tags)
        for run, latest, tags in store.runs_overview()
    ]


# -- one run's versions -------------------------------------------------------------------------


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
class RunPage:
    """One page of a run's versions, sorted over all of them before paginating."""

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

    def url(self, *, page: int | None = None, sort: str | None = None, order: Order | None = None) -> str:
        """This page's URL with some parameters changed (defaults left out)."""
        page, sort, order = page or self.page, sort or self.sort, order or self.order
        return _url(
            run_url(self.run_id),
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


def _sort_value(sort: str) -> Any:
    if sort in SORT_COLUMNS:
        return SORT_COLUMNS[sort]
    if _METRIC_SORT.fullmatch(sort):
        name = sort.removeprefix("metric:")
        return lambda v: v.metrics.get(name)
    raise InvalidInputError(
        f"cannot sort by {sort[:80]!r}: use one of {', '.join(SORT_COLUMNS)} or metric:<name>, e.g. metric:loss"
    )


def sort_versions(versions: list[VersionInfo], sort: str, order: Order) -> list[VersionInfo]:
    """``versions`` sorted by ``sort``; versions without a value (no step, no such metric) go last."""
    value = _sort_value(sort)
    present = [v for v in versions if value(v) is not None]
    absent = sorted((v for v in versions if value(v) is None), key=lambda v: -v.version)
    present.sort(key=lambda v: (value(v), v.version), reverse=order == "desc")
    return present + absent


def run_page(
    store: Store, run_id: str, *, page: int = 1, per_page: int = PER_PAGE, sort: str = "version", order: Order = "desc"
) -> RunPage:
    """Page ``page`` of ``run_id``'s versions sorted by ``sort`` ('version', 'step', 'metric:loss', …)."""
    versions = store.versions(run_id)
    ordered = sort_versions(versions, sort, order)
    pages = max(1, math.ceil(len(ordered) / per_page))
    if page > pages:
        raise NotFoundError(f"run {run_id!r} has {pages} pages of {per_page} versions; there is no page {page}")
    rows = ordered[(page - 1) * per_page : page * per_page]
    names = sorted({name for v in rows for name in v.metrics})
    # The policy's verdict on every version is worked out from the same list the page shows.
    policy = Policy.of(store.get_retention(run_id))
    tagged = {v.version for v in versions if v.tags}
    reasons = keep_reasons(policy, {v.version: v.metrics for v in versions}, tagged)
    view = RetentionView(policy, {number: list(why) for number, why in reasons.items()})
    return RunPage(run_id, rows, names, len(ordered), page, pages, per_page, sort, order, view)


# -- one version --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a version page; ``shared`` is None when there is no parent to compare with."""

    entry: TensorEntry
    name: str
    shared: bool | None


@dataclass
class Section:
    """The tensors of one section (model, optimizer state, …) with their total size."""

    title: str
    prefix: str
    rows: list[TensorRow] = field(default_factory=list)
    count: int = 0
    nbytes: int = 0

    @property
    def hidden(self) -> int:
        """Tensors not listed because the section passed :data:`MAX_ROWS`."""
        return self.count - len(self.rows)


@dataclass(frozen=True)
class VersionPage:
    """A version's header figures and its tensors grouped by section."""

    info: VersionInfo
    manifest: Manifest
    parent_exists: bool
    sections: list[Section]
    model_bytes: int
    shared_bytes: int | None

    @property
    def trainable_share(self) -> float | None:
        """Trainable bytes over model bytes (None without model tensors)."""
        return self.info.bytes_trainable / self.model_bytes if self.model_bytes else None


def section_of(key: str) -> tuple[str, str]:
    """(section title, prefix) of a tensor key."""
    for title, prefix in SECTIONS:
        if key.startswith(prefix) and len(key) > len(prefix):
            return title, prefix
    return "Extra", ""


def find_version(store: Store, run_id: str, version: int) -> VersionInfo:
    """The record of one version (tags and sizes); NotFoundError if it went away meanwhile."""
    return store.version(run_id, version)


def _parent_digests(store: Store, manifest: Manifest) -> set[str] | None:
    if manifest.parent is None:
        return None
    try:
        return store.manifest(manifest.run_id, manifest.parent).digests()
    except NotFoundError:  # the parent was deleted: nothing to compare with
        return None


def version_page(store: Store, run_id: str, ref: str) -> VersionPage:
    """The version ``ref`` names, each tensor marked shared if its bytes are in the parent too."""
    manifest = store.manifest(run_id, ref)
    info = find_version(store, run_id, manifest.version)
    parent = _parent_digests(store, manifest)
    sections: dict[str, Section] = {}
    shared_bytes = 0
    for entry in manifest.tensors:
        title, prefix = section_of(entry.key)
        section = sections.setdefault(title, Section(title, prefix))
        shared = None if parent is None else set(entry.digests()) <= parent
        section.count += 1
        section.nbytes += entry.nbytes
        shared_bytes += entry.nbytes if shared else 0
        if len(section.rows) < MAX_ROWS:
            section.rows.append(TensorRow(entry, entry.key.removeprefix(prefix), shared))
    order = list(dict.fromkeys(title for title, _ in SECTIONS))
    ordered = [sections[title] for title in order if title in sections]
    model = sections.get("Model")
    return VersionPage(
        info,
        manifest,
        parent is not None,
        ordered,
        model.nbytes if model else 0,
        None if parent is None else shared_bytes,
    )


@dataclass(frozen=True)
class TensorDownload:
    """A whole stored tensor's bytes: where they are and what to call the file."""

    filename: str
    nbytes: int
    chunks: Iterator[bytes | memoryview]


def tensor_download(store: Store, run_id: str, ref: str, key: str) -> TensorDownload:
    """The raw bytes of tensor ``key`` of a version (stored whole; chunked tensors are refused)."""
    manifest = store.manifest(run_id, ref)
    entry = next((e for e in manifest.tensors if e.key == key), None)
    if entry is None:
        raise NotFoundError(f"version {manifest.version} of run {run_id!r} has no tensor {key[:200]!r}")
    if entry.digest is None:
        raise InvalidInputError(
            f"tensor {key[:200]!r} is stored in {len(entry.digests())} chunks; load it with the client instead"
        )
    location = store.locate([entry.digest])[entry.digest]
    name = f"{entry.digest[:16]}.{entry.dtype.lower()}.bin"
    chunks = store.iter_shard(location.shard_id, location.offset, location.nbytes, PIECE_BYTES)
    return TensorDownload(name, location.nbytes, chunks)


# -- the diff between two versions ---------------------------------------------------------------


@dataclass(frozen=True)
class DiffPage:
    """Two versions compared: totals per status, the tensors shown and the changed values."""

    run_id: str
    diff: VersionDiff
    rows: list[TensorChange]
    shown_all: bool
    hidden: int
    values: list[tuple[str, str, str]]

    def url(self, *, show_all: bool) -> str:
        """This diff with or without the unchanged tensors."""
        path = f"{run_url(self.run_id)}/diff"
        return _url(path, a=self.diff.version_a, b=self.diff.version_b, all=1 if show_all else None)


def _shown_json(value: Any) -> str:
    return "—" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def pick_pair(a: str | None, b: str | None, ticked: list[str]) -> tuple[str, str, bool]:
    """The two refs to compare: ``a`` and ``b``, or the two ticked rows (then in version order)."""
    if a and b:
        return a, b, False
    if len(ticked) == 2 and not (a or b):
        return ticked[0], ticked[1], True
    raise InvalidInputError("pick two versions to compare: /runs/<run>/diff?a=3&b=5 (or tick exactly two rows)")


def diff_page(
    store: Store, run_id: str, a: str, b: str, *, by_number: bool = False, show_all: bool = False
) -> DiffPage:
    """Compare versions ``a`` and ``b`` (numbers, tags or 'latest'); ``by_number`` puts the older first."""
    refs = [parse_ref(a), parse_ref(b)]
    if by_number:
        refs.sort(key=lambda r: store.resolve(run_id, r))
    older, newer = store.manifest(run_id, refs[0]), store.manifest(run_id, refs[1])
    diff = diff_manifests(older, newer)
    rows = diff.tensors if show_all else [t for t in diff.tensors if t.status != "unchanged"]
    values = [(v.path, _shown_json(v.before), _shown_json(v.after)) for v in diff.values]
    return DiffPage(run_id, diff, rows[:MAX_ROWS], show_all, len(rows) - min(len(rows), MAX_ROWS), values)


# -- filters the templates use -------------------------------------------------------------------

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_size(nbytes: int) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB as a whole number)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def percent(share: float | None) -> str:
    """0.875 -> '87.5%'; None -> '—'."""
    return "—" if share is None else f"{share * 100:.1f}%"


def number(value: float | None) -> str:
    """A metric or step for a table cell: six significant digits, '—' when absent."""
    if value is None:
        return "—"
    return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"


def when(moment: datetime) -> str:
    """A creation time as 'YYYY-MM-DD HH:MM:SS UTC'."""
    aware = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return aware.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def shape(dims: list[int]) -> str:
    """[4, 4] -> '4 × 4'; a scalar -> 'scalar'."""
    return " × ".join(str(d) for d in dims) if dims else "scalar"
