"""Summaries of versions and runs, read from the summary columns only.

A listing never reads a manifest: the ``versions`` table's summary columns hold every figure a
list shows, so listing a thousand versions of a model with tens of thousands of tensors reads
a thousand short rows. Statements are Core selects built once and read as plain tuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, case, func, literal, select, union
from sqlalchemy.orm import Session

from ckptstore.service.catalog.versions import require_run, resolve_ref
from ckptstore.service.db import Database
from ckptstore.service.db.models import Run, Tag, Version, table
from ckptstore.service.format.names import NON_FINITE
from ckptstore.service.format.records import RunInfo, VersionInfo, tags_by_version

_VERSIONS = table(Version)
_TAGS = table(Tag)
_RUNS = table(Run)
#: The columns a :class:`VersionInfo` is built from, in its field order (tags apart).
SUMMARY_COLUMNS = (
    _VERSIONS.c.run_id,
    _VERSIONS.c.version,
    _VERSIONS.c.parent,
    _VERSIONS.c.created_at,
    _VERSIONS.c.step,
    _VERSIONS.c.metrics,
    _VERSIONS.c.tensors_total,
    _VERSIONS.c.tensors_new,
    _VERSIONS.c.bytes_total,
    _VERSIONS.c.bytes_new,
    _VERSIONS.c.bytes_trainable,
)
_OF_RUN = select(*SUMMARY_COLUMNS).where(_VERSIONS.c.run_id == bindparam("run_id")).order_by(_VERSIONS.c.version)
_ONE = select(*SUMMARY_COLUMNS).where(
    _VERSIONS.c.run_id == bindparam("run_id"), _VERSIONS.c.version == bindparam("version")
)
_TAGS_OF_RUN = select(_TAGS.c.version, _TAGS.c.name).where(_TAGS.c.run_id == bindparam("run_id"))
_NEWEST = (
    select(_VERSIONS.c.run_id, func.max(_VERSIONS.c.version).label("version")).group_by(_VERSIONS.c.run_id).subquery()
)
# Every run's newest version in one statement (the index page showed them with a query per run).
_LATEST_OF_EVERY_RUN = select(*SUMMARY_COLUMNS).join(
    _NEWEST, (_NEWEST.c.run_id == _VERSIONS.c.run_id) & (_NEWEST.c.version == _VERSIONS.c.version)
)
_EVERY_TAG = select(_TAGS.c.run_id, _TAGS.c.version, _TAGS.c.name)
_RUN_TOTALS = select(
    _VERSIONS.c.run_id,
    func.count(),
    func.max(_VERSIONS.c.version),
    func.coalesce(func.sum(_VERSIONS.c.bytes_total), 0),
    func.coalesce(func.sum(_VERSIONS.c.bytes_new), 0),
).group_by(_VERSIONS.c.run_id)
# Columns, not Run objects: `ckptstore ls` of a thousand runs built a thousand ORM objects, and
# its first ORM query imported SQLAlchemy's loading machinery.
_EVERY_RUN = select(_RUNS.c.id, _RUNS.c.created_at, _RUNS.c.updated_at).order_by(_RUNS.c.updated_at.desc(), _RUNS.c.id)


def all_runs(session: Session) -> list[RunInfo]:
    """Every run with its totals, most recently updated first."""
    totals = {run_id: (count, latest, total, new) for run_id, count, latest, total, new in session.execute(_RUN_TOTALS)}
    result = []
    for run_id, created_at, updated_at in session.execute(_EVERY_RUN):
        count, latest, total, new = totals.get(run_id, (0, None, 0, 0))
        result.append(
            RunInfo(
                run_id=run_id,
                created_at=created_at,
                updated_at=updated_at,
                versions=count,
                latest_version=latest,
                bytes_total=int(total),
                bytes_new=int(new),
            )
        )
    return result


def run_versions(session: Session, run_id: str) -> list[VersionInfo]:
    """Every version of ``run_id`` (which the caller checked exists), oldest first."""
    connection = session.connection()
    tags = tags_by_version(connection.execute(_TAGS_OF_RUN, {"run_id": run_id}))
    rows = connection.execute(_OF_RUN, {"run_id": run_id})
    return [VersionInfo.from_summary(row, tags.get(row[1], [])) for row in rows]


def one_version(session: Session, run_id: str, version: int) -> VersionInfo | None:
    """The summary of one version, or None if there is no such version."""
    connection = session.connection()
    row = connection.execute(_ONE, {"run_id": run_id, "version": version}).first()
    if row is None:
        return None
    tags = tags_by_version(connection.execute(_TAGS_OF_RUN, {"run_id": run_id}))
    return VersionInfo.from_summary(row, tags.get(version, []))


def latest_versions(session: Session) -> tuple[dict[str, VersionInfo], dict[str, list[tuple[str, int]]]]:
    """Every run's newest version, and every run's tags as sorted ``(name, version)`` pairs."""
    connection = session.connection()
    tags: dict[str, list[tuple[str, int]]] = {}
    for run_id, version, name in connection.execute(_EVERY_TAG):
        tags.setdefault(run_id, []).append((name, version))
    for pairs in tags.values():
        pairs.sort()
    latest = {}
    for row in connection.execute(_LATEST_OF_EVERY_RUN):
        names = sorted(name for name, version in tags.get(row[0], []) if version == row[1])
        latest[row[0]] = VersionInfo.from_summary(row, names)
    return latest, tags


def list_runs(*, db: Database) -> list[RunInfo]:
    """Every run with its totals, most recently updated first; see :meth:`Store.runs`."""
    with db.transaction() as session:
        return all_runs(session)


def list_versions(*, db: Database, run_id: str) -> list[VersionInfo]:
    """Every version of ``run_id``, oldest first; NotFoundError if there is no such run."""
    with db.transaction() as session:
        require_run(session, run_id)
        return run_versions(session, run_id)


def version_summary(*, db: Database, run_id: str, ref: int | str) -> VersionInfo:
    """The summary of the one version ``ref`` names; NotFoundError if it names none."""
    with db.transaction() as session:
        number = resolve_ref(session, run_id, ref)
        info = one_version(session, run_id, number)
        assert info is not None  # resolved in this transaction
        return info


def overview(*, db: Database) -> list[tuple[RunInfo, VersionInfo | None, list[tuple[str, int]]]]:
    """Every run with its newest version and its tags; see :meth:`Store.runs_overview`."""
    runs = list_runs(db=db)
    with db.transaction() as session:
        latest, tags = latest_versions(session)
    return [(run, latest.get(run.run_id), tags.get(run.run_id, [])) for run in runs]


# -- filtered, sorted and sampled listings of one run (the run page) -------------------------------

#: Columns a filtered listing sorts by, besides a metric.
SORTABLE = {
    "version": _VERSIONS.c.version,
    "step": _VERSIONS.c.step,
    "bytes_total": _VERSIONS.c.bytes_total,
    "bytes_new": _VERSIONS.c.bytes_new,
}


@dataclass(frozen=True)
class VersionFilter:
    """Which versions of a run a listing keeps; every field left None keeps them all.

    ``tag`` is a glob over the run's tag names (``*`` any text, ``?`` one character; case is
    ignored): a version is kept when a tag matching it points at the version. ``metric`` with
    ``low`` and ``high`` (inclusive, either may be None) keeps versions whose metric lies in the
    range; a version without the metric, or with a NaN or infinite one, is left out. ``having``
    keeps versions that report that metric at all, NaN included.
    """

    tag: str | None = None
    metric: str | None = None
    low: float | None = None
    high: float | None = None
    having: str | None = None


def like_pattern(glob: str) -> str:
    """A glob (``*``, ``?``) as a LIKE pattern escaped with a backslash, lower case."""
    escaped = glob.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def _metric(table: Any, name: str) -> Any:
    """The metric as a number where it is finite; NULL where it is absent, NaN or infinite (the
    column holds those as "NaN", "Infinity", "-Infinity"), so ranges leave them out and sorts put
    them last, alike on SQLite and PostgreSQL."""
    value = table.c.metrics[name]
    return case((value.as_string().in_(list(NON_FINITE)), None), else_=value.as_float())


def _reported(table: Any, name: str) -> Any:
    """Whether a version reports the metric at all, whatever its value."""
    return table.c.metrics[name].as_string().is_not(None)


def _conditions(table: Any, run_id: str, where: VersionFilter) -> list[Any]:
    conditions = [table.c.run_id == run_id]
    if where.tag is not None:
        tagged = select(_TAGS.c.version).where(
            _TAGS.c.run_id == run_id, func.lower(_TAGS.c.name).like(like_pattern(where.tag), escape="\\")
        )
        conditions.append(table.c.version.in_(tagged))
    if where.metric is not None:
        value = _metric(table, where.metric)
        conditions.append(value.is_not(None))
        if where.low is not None:
            conditions.append(value >= where.low)
        if where.high is not None:
            conditions.append(value <= where.high)
    if where.having is not None:
        conditions.append(_reported(table, where.having))
    return conditions


def _with_tags(connection: Any, run_id: str, rows: Any) -> list[VersionInfo]:
    """The rows as versions with their tags (only the tags of these versions are read)."""
    found = list(rows)
    numbers = [row[1] for row in found]
    statement = select(_TAGS.c.version, _TAGS.c.name).where(_TAGS.c.run_id == run_id, _TAGS.c.version.in_(numbers))
    tags = tags_by_version(connection.execute(statement)) if found else {}
    return [VersionInfo.from_summary(row, tags.get(row[1], [])) for row in found]


def version_span(*, db: Database, run_id: str, where: VersionFilter) -> tuple[int, int | None, int | None]:
    """(count, lowest, highest version number) of the run's versions ``where`` keeps.

    NotFoundError if there is no such run. One aggregate statement: the count is worked out in
    the database, no row comes back per version.
    """
    statement = select(func.count(), func.min(_VERSIONS.c.version), func.max(_VERSIONS.c.version)).where(
        *_conditions(_VERSIONS, run_id, where)
    )
    with db.transaction() as session:
        require_run(session, run_id)
        count, lowest, highest = session.connection().execute(statement).one()
    return int(count), lowest, highest


def sorted_versions(
    *,
    db: Database,
    run_id: str,
    where: VersionFilter,
    sort: str = "version",
    metric: str | None = None,
    descending: bool = True,
    offset: int = 0,
    limit: int = 50,
) -> list[VersionInfo]:
    """``limit`` of the versions ``where`` keeps from ``offset`` on, sorted in the database.

    The order is by ``metric`` when given, else by the :data:`SORTABLE` column ``sort``; ties go
    by version number in the same direction, and versions without a value (no step, no such
    metric, a NaN or infinite one) come last, newest first.
    """
    key = _metric(_VERSIONS, metric) if metric is not None else SORTABLE[sort]
    number = _VERSIONS.c.version
    order: list[Any]
    if key is number:  # never missing: the primary key's order, read from the index
        order = [number.desc() if descending else number.asc()]
    else:
        missing = key.is_(None)
        tie = case((missing, -number), else_=-number if descending else number)
        order = [missing, key.desc() if descending else key.asc(), tie]
    statement = (
        select(*SUMMARY_COLUMNS)
        .where(*_conditions(_VERSIONS, run_id, where))
        .order_by(*order)
        .offset(offset)
        .limit(limit)
    )
    with db.transaction() as session:
        connection = session.connection()
        return _with_tags(connection, run_id, connection.execute(statement))


def sampled_versions(
    *, db: Database, run_id: str, where: VersionFilter, lowest: int, highest: int, width: int
) -> list[VersionInfo]:
    """Some of the versions ``where`` keeps, oldest first: the first kept version in each run of
    ``width`` version numbers from ``lowest`` to ``highest``, and the newest kept version (at
    most ``(highest - lowest) // width + 2`` versions).

    Each pick is an index seek from the start of its run of numbers that stops at the first
    version kept, so the statement reads a bounded number of rows when every version is kept,
    whatever the run's history. With a filter, the database may step over the versions it
    leaves out, but returns no more rows.
    """
    width = max(1, width)
    buckets = (highest - lowest) // width + 1
    start = select(literal(0).label("k")).cte("buckets", recursive=True)
    start = start.union_all(select(start.c.k + 1).where(start.c.k + 1 < buckets))
    picked = _VERSIONS.alias("picked")
    low_edge = lowest + start.c.k * width
    first = (
        select(picked.c.version)
        .where(*_conditions(picked, run_id, where), picked.c.version >= low_edge, picked.c.version < low_edge + width)
        .order_by(picked.c.version)
        .limit(1)
        .scalar_subquery()
    )
    newest = _VERSIONS.alias("newest")
    last = (
        select(newest.c.version).where(*_conditions(newest, run_id, where)).order_by(newest.c.version.desc()).limit(1)
    )
    wanted = union(select(first).select_from(start), select(last.scalar_subquery()))
    statement = (
        select(*SUMMARY_COLUMNS)
        .where(_VERSIONS.c.run_id == run_id, _VERSIONS.c.version.in_(wanted))
        .order_by(_VERSIONS.c.version)
    )
    with db.transaction() as session:
        connection = session.connection()
        return _with_tags(connection, run_id, connection.execute(statement))


__all__ = [
    "SORTABLE",
    "SUMMARY_COLUMNS",
    "VersionFilter",
    "all_runs",
    "latest_versions",
    "like_pattern",
    "list_runs",
    "list_versions",
    "one_version",
    "sampled_versions",
    "sorted_versions",
    "version_span",
    "overview",
    "run_versions",
    "version_summary",
]
