"""``ckptstore tag``, ``untag``, ``rm`` and ``gc``: naming, deleting and reclaiming versions."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from ckptstore.client.cli.common import UsageProblem, echo, echo_json, open_client, parse_target, reported, size
from ckptstore.client.cli.counts import agree, counted
from ckptstore.client.cli.shown import shown
from ckptstore.service.format.names import validate_run_id, validate_tag
from ckptstore.service.format.records import GcReport

#: ``--grace`` units: seconds, minutes, hours, days.
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> int:
    """Whole seconds in ``0``, ``90``, ``90s``, ``30m``, ``1h``, ``1.5h`` or ``2d``."""
    from ckptstore.service.reclaim.gc import (
        MAX_GRACE_SECONDS,  # here: the engine's imports are not the CLI's to pay at start
    )

    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageProblem(f"duration {text!r}: write a number with an optional unit s, m, h or d, e.g. 30m or 1h")
    seconds = int(float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()])
    if seconds > MAX_GRACE_SECONDS:
        raise UsageProblem(f"duration {text!r} is longer than {MAX_GRACE_SECONDS // 86400} days")
    return seconds


def tag(
    target: Annotated[str, typer.Argument(metavar="RUN[@REF]", help="The version to tag (default: latest).")],
    name: Annotated[str, typer.Argument(help="The tag: a letter, then letters, digits, '.', '_' or '-'.")],
) -> None:
    """Point tag NAME at a version (moving it if the run already has it)."""
    with reported():
        parsed = parse_target(target)
        validate_tag(name)
        with open_client() as ckpt:
            version = ckpt.tag(parsed.run_id, parsed.ref, name)
    echo(f"{parsed.run_id}@{name} -> version {version}")


def untag(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run holding the tag.")],
    name: Annotated[str, typer.Argument(help="The tag to remove.")],
) -> None:
    """Remove tag NAME from RUN (the version itself stays)."""
    with reported():
        validate_run_id(run_id)
        validate_tag(name)
        with open_client() as ckpt:
            ckpt.untag(run_id, name)
    echo(f"removed tag {name} from {run_id}")


def rm(
    target: Annotated[str, typer.Argument(metavar="RUN[@REF]", help="The version to delete (default: latest).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete one version and its tags. Its stored bytes are reclaimed later by `ckptstore gc`."""
    with reported():
        parsed = parse_target(target)
        with open_client() as ckpt:
            # Resolve first and delete by number: 'latest' or a tag may move while we ask.
            version = ckpt.transport.resolve(parsed.run_id, parsed.ref)
            if not yes:
                typer.confirm(
                    shown(f"Delete version {version} of run {parsed.run_id!r}? This cannot be undone"), abort=True
                )
            ckpt.delete(parsed.run_id, version)
    echo(f"deleted {parsed.run_id}@{version}; shards only it referenced stay stored until `ckptstore gc` reclaims them")


def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be reclaimed.")] = False,
    grace: Annotated[
        str, typer.Option("--grace", metavar="DURATION", help="Spare shards newer than this: 1h, 30m, 90s, 0.")
    ] = "1h",
    orphans: Annotated[
        bool,
        typer.Option(
            "--orphans",
            help="Also delete blobs no shard record names, abort S3 uploads left unfinished for longer "
            "than the grace period (run while no save uploads), and remove the temporary files killed saves "
            "left in the staging folders (those no live process is writing).",
        ),
    ] = False,
    compact_below: Annotated[
        float | None,
        typer.Option(
            "--compact-below",
            metavar="FRACTION",
            help="First rewrite the live tensors of shards whose live bytes are below this share of their size "
            "(e.g. 0.5); the old shards go once the grace period has passed.",
        ),
    ] = None,
    compress: Annotated[
        bool,
        typer.Option(
            "--compress",
            help="First compress what versions older than the grace period added (byte-grouped zstd, or zstd "
            "deltas on an earlier version's tensor); the raw shards go once the grace period has passed.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON for scripts.")] = False,
) -> None:
    """Reclaim the stored bytes of shards no committed version references.

    Shards stored, or reported present to a save, within the grace period are kept, so a save
    in progress is never affected; `--grace 0` keeps nothing unreferenced. On a server this
    needs an admin token. --json prints dry_run, grace_seconds, shards_swept, tensors_swept,
    bytes_swept, shards_kept, shards_in_grace, orphan_blobs, orphan_bytes, orphans_swept,
    stale_uploads, stale_upload_bytes, uploads_aborted, shards_compacted, bytes_compacted,
    versions_compressed, tensors_compressed, tensors_as_deltas, bytes_before_compression,
    bytes_after_compression, staging_files_swept, staging_bytes_swept, seconds.
    """
    with reported():
        seconds = parse_duration(grace)
        with open_client() as ckpt:
            report = ckpt.gc(
                grace_seconds=seconds, dry_run=dry_run, orphans=orphans, compact_below=compact_below, compress=compress
            )
    if as_json:
        echo_json(report.model_dump(mode="json"))
        return
    verb = "would sweep" if report.dry_run else "swept"
    echo(
        f"{verb} {counted(report.shards_swept, 'shard')} ({counted(report.tensors_swept, 'tensor')}, "
        f"{size(report.bytes_swept)}) "
        f"in {report.seconds:.2f} s"
    )
    echo(
        f"kept {counted(report.shards_kept, 'shard')}, {report.shards_in_grace} of them unreferenced but within "
        f"the {grace.strip()} grace period"
    )
    _echo_rewrites(report, compress=compress, compact=compact_below is not None)
    if report.orphan_blobs:
        what = (
            f"{counted(report.orphan_blobs, 'blob')} ({size(report.orphan_bytes)}) "
            f"{agree(report.orphan_blobs, 'has', 'have')} no shard record"
        )
        if report.orphans_swept:
            echo(f"{what}; deleted {report.orphans_swept}")
        else:
            echo(f"{what}; `ckptstore gc --orphans` deletes them while no save is uploading")
    if report.stale_uploads:
        what = (
            f"{counted(report.stale_uploads, 'unfinished upload')} ({size(report.stale_upload_bytes)} in parts) "
            f"had nothing added for longer than the grace period"
        )
        if report.uploads_aborted:
            echo(f"{what}; aborted {report.uploads_aborted}")
        elif orphans and report.dry_run:
            echo(f"{what}; would abort them")
        else:
            echo(f"{what}; `ckptstore gc --orphans` aborts them")
    if report.staging_files_swept:
        echo(
            f"{'would remove' if report.dry_run else 'removed'} "
            f"{counted(report.staging_files_swept, 'temporary file')} ({size(report.staging_bytes_swept)}) "
            "that killed saves left in the staging folders"
        )
    if report.dry_run:
        echo("dry run: nothing was deleted")


def _echo_rewrites(report: GcReport, *, compress: bool, compact: bool) -> None:
    """The lines of a gc report about what compression and compaction rewrote."""
    if compress:
        before, after = report.bytes_before_compression, report.bytes_after_compression
        share = f" ({after / before:.2f}x)" if before else ""
        echo(
            f"{'would compress' if report.dry_run else 'compressed'} {counted(report.tensors_compressed, 'tensor')} of "
            f"{counted(report.versions_compressed, 'version')} ({report.tensors_as_deltas} as deltas): {size(before)} "
            f"stored in {size(after)}{share}; the raw copies go once the grace period has passed"
        )
    if compact:
        echo(
            f"{'would compact' if report.dry_run else 'compacted'} {counted(report.shards_compacted, 'shard')}: "
            f"{size(report.bytes_compacted)} freed once the grace period has passed"
        )
