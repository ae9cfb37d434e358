"""The ``ckptstore`` command line (works on ``CKPTSTORE_URL`` or the embedded ``CKPTSTORE_HOME``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from service.records import RunInfo, VersionInfo

app = typer.Typer(
    help="ckptstore: a checkpoint store for PyTorch training.", no_args_is_help=True, add_completion=False
)


@app.callback()
def main() -> None:
    """Save, load and inspect PyTorch checkpoints."""


@app.command()
def quickstart() -> None:
    """Save and load a small adapter model on the embedded store, printing the dedup saving."""
    from client.quickstart import run

    run()


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _print_runs(runs: list[RunInfo]) -> None:
    typer.echo(f"{'RUN':<32} {'VERSIONS':>8} {'LATEST':>6} {'LOGICAL':>11} {'STORED':>11}  UPDATED")
    for run in runs:
        typer.echo(
            f"{run.run_id:<32} {run.versions:>8} {run.latest_version or '-':>6} "
            f"{_size(run.bytes_total):>11} {_size(run.bytes_new):>11}  {run.updated_at:%Y-%m-%d %H:%M}"
        )


def _print_versions(versions: list[VersionInfo]) -> None:
    typer.echo(f"{'VERSION':>7} {'STEP':>8} {'LOGICAL':>11} {'NEW':>11} {'DEDUP':>6}  {'CREATED':<16}  TAGS")
    for version in versions:
        step = "-" if version.step is None else str(version.step)
        typer.echo(
            f"{version.version:>7} {step:>8} {_size(version.bytes_total):>11} {_size(version.bytes_new):>11} "
            f"{version.dedup_ratio:>6.1%}  {version.created_at:%Y-%m-%d %H:%M}  {','.join(version.tags)}"
        )


@app.command("ls")
def list_(
    run_id: Annotated[str | None, typer.Argument(help="A run: list its versions instead of the runs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """List runs, or the versions of RUN_ID."""
    from client import CheckpointError, default_client

    try:
        if run_id is None:
            runs = default_client().runs()
            rows = [r.model_dump(mode="json") for r in runs]
        else:
            versions = default_client().versions(run_id)
            rows = [v.model_dump(mode="json") for v in versions]
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    elif run_id is None:
        _print_runs(runs)
    else:
        _print_versions(versions)


if __name__ == "__main__":
    app()
