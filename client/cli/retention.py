"""``ckptstore retention``: show, set, clear or apply a run's retention policy."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from ckptstore.client.cli.common import UsageProblem, echo, echo_json, open_client, reported
from ckptstore.client.cli.shown import shown
from ckptstore.service.catalog.retention_rules import Policy, check_policy
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.names import validate_run_id
from ckptstore.service.format.records import RetentionPolicy


def _versions(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


def _versions_named(numbers: list[int]) -> str:
    """``version 3`` or ``versions 3, 4``."""
    return f"{'version' if len(numbers) == 1 else 'versions'} {_versions(numbers)}"


def _print(record: RetentionPolicy, removed: list[int] | None) -> None:
    echo(f"run:    {record.run_id}")
    echo(f"policy: {Policy.of(record).describe()}")
    if removed is not None:
        echo(f"removed versions: {_versions(removed) or 'none'}")
        if removed:
            echo("their shards stay stored until `ckptstore gc` reclaims them")
    elif record.would_remove:
        echo(f"not kept: {_versions_named(record.would_remove)} (removed at the next commit, or now with --apply)")
    elif Policy.of(record).active:
        echo("not kept: none (the policy keeps every version as the run stands)")


def retention(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run whose policy to show or change.")],
    keep_last: Annotated[int | None, typer.Option("--keep-last", min=1, help="Keep the N newest versions.")] = None,
    keep_best: Annotated[
        int | None, typer.Option("--keep-best", min=1, help="Keep the K best versions by --metric.")
    ] = None,
    metric: Annotated[str | None, typer.Option(help="The metric --keep-best ranks by, e.g. loss.")] = None,
    mode: Annotated[str | None, typer.Option(help="min: lower is better (the default); max: higher is better.")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the policy: keep every version.")] = False,
    apply: Annotated[
        bool, typer.Option("--apply", help="Remove now what the policy does not keep, instead of at the next commit.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before --apply removes versions.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Show RUN's retention policy and the versions it would remove, or replace it.

    A policy keeps the last N versions (--keep-last), the best K by a metric (--keep-best,
    --metric, --mode), every tagged version and the newest; each commit removes the other
    versions. Setting a policy replaces the whole policy (rules not given are dropped) and
    removes nothing yet: the next commit applies it, or --apply does now. On a server, setting
    or applying a policy needs an admin token.

    --json prints the policy: run_id, keep_last, keep_best, metric, mode and would_remove
    (the versions the next commit would remove), plus removed with --apply.
    """
    setting = (keep_last, keep_best, metric, mode) != (None, None, None, None)
    with reported():
        validate_run_id(run_id)
        if setting and clear:
            raise UsageProblem("--clear removes the policy; it cannot be combined with --keep-last or --keep-best")
        if mode is not None and mode not in ("min", "max"):
            raise UsageProblem(f"--mode must be min or max, not {mode!r}")
        if keep_best is None and (metric is not None or mode is not None):
            raise UsageProblem("--metric and --mode go with --keep-best, e.g. --keep-best 2 --metric loss")
        if keep_best is not None and metric is None:
            raise UsageProblem("--keep-best needs --metric, the metric to rank by, e.g. --metric loss")
        try:
            wanted = check_policy(keep_last, keep_best, metric, mode)
        except InvalidInputError as exc:
            raise UsageProblem(str(exc)) from exc
        chosen: Literal["min", "max"] = "max" if wanted.mode == "max" else "min"
        removed: list[int] | None = None
        with open_client() as ckpt:
            if setting or clear:
                record = ckpt.set_retention(run_id, wanted.keep_last, wanted.keep_best, wanted.metric, chosen)
            else:
                record = ckpt.retention(run_id)
            if apply:
                if record.would_remove and not yes:
                    question = (
                        f"Remove {_versions_named(record.would_remove)} of run {run_id!r} now? This cannot be undone"
                    )
                    typer.confirm(shown(question), abort=True)
                removed = ckpt.apply_retention(run_id)
                record = ckpt.retention(run_id)
    if as_json:
        echo_json({**record.model_dump(mode="json"), **({"removed": removed} if removed is not None else {})})
    else:
        _print(record, removed)
