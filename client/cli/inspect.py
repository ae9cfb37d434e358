"""``ckptstore ls``, ``show`` and ``diff``: runs and versions, a version's summary and tensors, and
what changed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from ckptstore.client import keys
from ckptstore.client.cli.common import echo, echo_json, open_client, parse_target, reported, server_url, size, table
from ckptstore.client.cli.counts import counted
from ckptstore.client.cli.shown import shown
from ckptstore.service.errors import NotFoundError
from ckptstore.service.format.names import validate_run_id
from ckptstore.service.format.records import RunInfo, VersionInfo

if TYPE_CHECKING:  # imported where used: ``ckptstore ls`` needs neither
    from ckptstore.service.catalog.diff import VersionDiff
    from ckptstore.service.format.manifest import Manifest, TensorEntry

#: Key prefix -> section title, in the order sections are shown.
SECTIONS = (
    ("model/", "model"),
    ("optim/state/", "optimizer state"),
    ("optim/param_groups/", "optimizer param groups"),
    ("scheduler/", "scheduler"),
    ("extra/", "extra"),
    ("resume/", "resume"),
)

#: JSON state section -> title, for sections that hold no tensors.
STATE_TITLES = {"optim": "optimizer", "scheduler": "scheduler", "extra": "extra", "resume": "resume"}

Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

#: ``ls RUN`` shows at most this many metric columns (the first by name); --json has them all.
MAX_METRIC_COLUMNS = 8


def _shape(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _section(key: str) -> tuple[str, str]:
    """(section title, the key's name within it)."""
    for prefix, title in SECTIONS:
        if key.startswith(prefix):
            name = keys.model_name(key) if prefix == "model/" else key.removeprefix(prefix)
            return title, name
    head, _, rest = key.partition("/")
    return head, rest


def _trainable(entry: TensorEntry) -> str:
    return "-" if entry.trainable is None else ("yes" if entry.trainable else "no")


def _print_summary(info: VersionInfo) -> None:
    parent = f" (parent {info.parent})" if info.parent is not None else ""
    metrics = "  ".join(f"{name}={value:g}" for name, value in sorted(info.metrics.items()))
    rows = [
        ("run", info.run_id),
        ("version", f"{info.version}{parent}, created {info.created_at:%Y-%m-%d %H:%M:%S %Z}".rstrip()),
        ("step", "-" if info.step is None else str(info.step)),
        ("metrics", metrics or "-"),
        ("tags", ", ".join(info.tags) or "-"),
        (
            "size",
            f"{size(info.bytes_total)} logical, {size(info.bytes_new)} new ({info.dedup_ratio:.1%} deduplicated), "
            f"{size(info.bytes_trainable)} trainable",
        ),
        ("tensors", f"{info.tensors_total} ({info.tensors_new} new)"),
    ]
    for label, value in rows:
        echo(f"{label:<9} {shown(value)}")


def _print_tensors(manifest: Manifest) -> None:
    grouped: dict[str, list[TensorEntry]] = {}
    for entry in manifest.tensors:
        grouped.setdefault(_section(entry.key)[0], []).append(entry)
    for title, entries in grouped.items():
        echo("")
        echo(f"{shown(title)}: {counted(len(entries), 'tensor')}, {size(sum(e.nbytes for e in entries))}")
        rows = [
            (
                _section(e.key)[1],
                e.dtype,
                _shape(list(e.shape)) + (f" in {counted(len(e.chunks), 'chunk')}" if e.chunks else ""),
                e.placement,
                e.device_type,
                _trainable(e),
                size(e.nbytes),
            )
            for e in entries
        ]
        table(("NAME", "DTYPE", "SHAPE", "PLACEMENT", "DEVICE", "TRAINABLE", "SIZE"), rows, right=(6,), indent="  ")
    for section in manifest.state:
        if not any(entry.key.startswith(f"{section}/") for entry in manifest.tensors):
            echo(f"\n{shown(STATE_TITLES.get(section, section))}: no tensors (JSON state only)")


def show(
    target: Annotated[str, typer.Argument(metavar="RUN[@REF]", help="A run, and a version number, 'latest' or a tag.")],
    as_json: Json = False,
) -> None:
    """Show a version: step, metrics, tags, sizes and dedup, then its tensors by section."""
    with reported():
        parsed = parse_target(target)
        with open_client() as ckpt:
            manifest = ckpt.transport.manifest(parsed.run_id, parsed.ref)
            found = [v for v in ckpt.versions(parsed.run_id) if v.version == manifest.version]
        if not found:
            raise NotFoundError(f"version {manifest.version} of run {parsed.run_id!r} was deleted meanwhile")
    info = found[0]
    if as_json:
        echo_json(
            {"version": info.model_dump(mode="json"), "manifest": manifest.model_dump(mode="json", exclude_none=True)}
        )
        return
    _print_summary(info)
    _print_tensors(manifest)


def _value(value: Any) -> str:
    return "-" if value is None else json.dumps(value)


def _print_diff(result: VersionDiff) -> None:
    echo(f"{result.run_a}@{result.version_a} -> {result.run_b}@{result.version_b}")
    totals = [(status, t.count, size(t.nbytes)) for status, t in result.totals.items()]
    table(("STATUS", "TENSORS", "BYTES"), totals, right=(1, 2))
    columns = {
        "changed": (("KEY", "BEFORE", "AFTER", "SIZE"), lambda c: (c.key, c.before, c.after, size(c.nbytes))),
        "added": (("KEY", "AFTER", "SIZE"), lambda c: (c.key, c.after, size(c.nbytes))),
        "removed": (("KEY", "BEFORE", "SIZE"), lambda c: (c.key, c.before, size(c.nbytes))),
    }
    for status, (headers, row) in columns.items():
        changes = [c for c in result.tensors if c.status == status]
        if changes:
            echo(f"\n{status} tensors ({len(changes)}):")
            table(headers, [row(c) for c in changes], right=(len(headers) - 1,), indent="  ")
    if result.values:
        echo(f"\nvalues ({len(result.values)}):")
        table(
            ("PATH", "BEFORE", "AFTER"),
            [(v.path, _value(v.before), _value(v.after)) for v in result.values],
            indent="  ",
        )
    if not result.values and all(t.count == 0 for s, t in result.totals.items() if s != "unchanged"):
        echo("\nno differences")


def diff(
    older: Annotated[str, typer.Argument(metavar="RUN@A", help="The version to compare from.")],
    newer: Annotated[str, typer.Argument(metavar="RUN@B", help="The version to compare to (may be another run).")],
    as_json: Json = False,
) -> None:
    """Compare two versions: tensors changed, added and removed; hyperparameter and metric changes."""
    with reported():
        a, b = parse_target(older, "RUN@A"), parse_target(newer, "RUN@B")
        from ckptstore.service.catalog.diff import diff_manifests

        with open_client() as ckpt:
            result = diff_manifests(ckpt.transport.manifest(a.run_id, a.ref), ckpt.transport.manifest(b.run_id, b.ref))
    if as_json:
        echo_json(result.model_dump(mode="json"))
    else:
        _print_diff(result)


def _print_runs(runs: list[RunInfo]) -> None:
    rows = [
        (
            run.run_id,
            run.versions,
            run.latest_version,
            size(run.bytes_total),
            size(run.bytes_new),
            f"{run.updated_at:%Y-%m-%d %H:%M}",
        )
        for run in runs
    ]
    table(("RUN", "VERSIONS", "LATEST", "LOGICAL", "STORED", "UPDATED"), rows, right=(1, 2, 3, 4))


def metric_value(value: float) -> str:
    """A metric as a table shows it: 4 significant digits (``0.1235``, ``1.235e+04``, ``12``)."""
    return f"{value:.4g}"


def _print_versions(versions: list[VersionInfo]) -> None:
    """One row per version: its number, step, one column per metric (``-`` where a version has
    none; at most :data:`MAX_METRIC_COLUMNS`, a note on stderr naming those left out), sizes,
    dedup, time and tags."""
    names = sorted({name for v in versions for name in v.metrics})
    columns, hidden = names[:MAX_METRIC_COLUMNS], names[MAX_METRIC_COLUMNS:]
    rows = [
        (
            v.version,
            v.step,
            *(metric_value(v.metrics[name]) if name in v.metrics else None for name in columns),
            size(v.bytes_total),
            size(v.bytes_new),
            f"{v.dedup_ratio:.1%}",
            f"{v.created_at:%Y-%m-%d %H:%M}",
            ",".join(v.tags),
        )
        for v in versions
    ]
    headers = ("VERSION", "STEP", *columns, "LOGICAL", "NEW", "DEDUP", "CREATED", "TAGS")
    table(headers, rows, right=tuple(range(len(columns) + 5)))
    if hidden:
        listed = ", ".join(shown(name) for name in hidden[:5]) + (", ..." if len(hidden) > 5 else "")
        echo(f"note: {len(hidden)} more metrics not shown ({listed}); --json lists every metric", err=True)


def _embedded_listing(run_id: str | None) -> list[RunInfo] | list[VersionInfo] | None:
    """The runs (or ``run_id``'s versions), read straight from an embedded store's SQLite file
    without importing SQLAlchemy (:mod:`service.catalog.embedded_runs`); None when the settings name a
    server or another database, or the reader does not apply: the store is then opened as every
    other command opens it."""
    if server_url() is not None:
        return None
    from ckptstore.service.settings import local_settings

    database = local_settings().embedded_database  # an invalid CKPTSTORE_* setting is refused here too
    if database is None:
        return None
    from ckptstore.service.catalog.embedded_runs import read_runs, read_versions

    return read_runs(database) if run_id is None else read_versions(database, run_id)


def list_(
    run_id: Annotated[str | None, typer.Argument(metavar="RUN", help="A run: list its versions instead.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """List runs, or the versions of RUN.

    --json prints a list of objects: for runs run_id, created_at, updated_at, versions,
    latest_version, bytes_total, bytes_new; for versions run_id, version, parent, created_at,
    tags, step, metrics, tensors_total, tensors_new, bytes_total, bytes_new, bytes_trainable.
    """
    with reported():
        if run_id is not None:
            validate_run_id(run_id)
        quick = _embedded_listing(run_id)
        if quick is not None:
            records: list[RunInfo] | list[VersionInfo] = quick
        else:
            with open_client() as ckpt:
                records = ckpt.runs() if run_id is None else ckpt.versions(run_id)
    if as_json:
        echo_json([r.model_dump(mode="json") for r in records])
    elif run_id is None:
        _print_runs(cast(list[RunInfo], records))
    else:
        _print_versions(cast(list[VersionInfo], records))
