"""``ckptstore export``, ``import`` and ``verify``: moving weights in and out, checking stored bytes.

The work is done in :mod:`client.formats.exporting`, :mod:`client.formats.importing` and
:mod:`client.loading.verify`; these commands parse, show progress and print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptstore.client.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageProblem,
    check_folder,
    echo,
    echo_json,
    open_client,
    open_saving_client,
    parse_size,
    parse_target,
    reported,
    size,
    table,
    writing_into,
)
from ckptstore.client.cli.counts import counted
from ckptstore.client.cli.shown import shown
from ckptstore.service.format.names import validate_run_id


class _Bar:
    """A byte bar whose total is set once known."""

    def __init__(self, description: str) -> None:
        from ckptstore.client.progress import byte_bar  # here: tqdm is not for the commands that show no bar

        self.bar = byte_bar(0, description)

    def total(self, n: int) -> None:
        self.bar.total = n
        self.bar.refresh()

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def export(
    target: Annotated[str, typer.Argument(metavar="RUN[@REF]", help="The version to export (default: latest).")],
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to write (created if absent).")],
    max_shard_size: Annotated[
        str, typer.Option(help="Split the model into files of at most this size: 500MB, 5GB (x1000), 1GiB (x1024).")
    ] = "5GB",
    optimizer: Annotated[
        bool, typer.Option("--optimizer", help="Also write optimizer.safetensors and optimizer.json.")
    ] = False,
    keys: Annotated[
        list[str] | None,
        typer.Option("--keys", help="Only tensors whose state_dict names match this glob, e.g. '*lora_*'; repeatable."),
    ] = None,
    as_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf (safetensors files), peft (an adapter folder), dcp (a DCP folder) or accelerate (a save_state "
            "folder); pt, ckpt (a torch.save or Lightning checkpoint file) or trainer (a Trainer checkpoint folder).",
        ),
    ] = "hf",
    peft_config: Annotated[
        Path | None,
        typer.Option(help="adapter_config.json for --format peft (default: the version's extra['peft_config'])."),
    ] = None,
) -> None:
    """Write a version's model as Hugging Face safetensors files under their state_dict names.

    One model.safetensors, or model-0000N-of-0000M.safetensors files with
    model.safetensors.index.json beyond --max-shard-size, and config.json when the version holds
    the model's config (a Trainer plug-in version or Trainer-folder import; never invented).
    Loadable by safetensors and, with config.json, by transformers' from_pretrained.
    """
    from ckptstore.client.formats.exporting import export_version

    if as_format in TRAINING_FORMATS:
        _export_training(target, directory, as_format, keys)
        return
    if as_format != "hf":
        _export_other(target, directory, as_format, peft_config, keys)
        return
    with reported():
        parsed = parse_target(target)
        limit = parse_size(max_shard_size)
        check_folder(directory)
        bar = _Bar("export")
        try:
            with open_client() as ckpt, writing_into(directory):
                result = export_version(
                    ckpt.transport,
                    parsed.run_id,
                    parsed.ref,
                    directory,
                    max_shard_bytes=limit,
                    optimizer=optimizer,
                    on_bytes=bar.update,
                    on_total=bar.total,
                    keys=keys,
                )
        finally:
            bar.close()
    written = shown(str(directory))
    echo(
        f"exported {result.run_id}@{result.version} to {written}: {counted(result.tensors, 'tensor')}, "
        f"{size(result.bytes)} in {result.seconds:.2f} s"
    )
    for name in result.files:
        echo(f"  {shown(name)}")
    if not (directory / "config.json").exists():
        echo(
            f"note: {written} has no config.json; transformers' from_pretrained needs the model's own config there",
            err=True,
        )


#: ``export --format`` values that write a training checkpoint (:mod:`client.formats.export_training`).
TRAINING_FORMATS = ("pt", "ckpt", "trainer")


def _export_training(target: str, directory: Path, as_format: str, keys: list[str] | None) -> None:
    """``export --format pt|ckpt|trainer``: DIR is the file written for pt and ckpt, the folder for trainer."""
    from ckptstore.client.formats.export_training import lightning, pt, trainer

    with reported():
        parsed = parse_target(target)
        if keys is not None:
            raise UsageProblem(f"--format {as_format} writes the whole version: leave out --keys")
        if as_format == "trainer":
            check_folder(directory)
        elif directory.is_dir():
            raise UsageProblem(
                f"{directory} is a folder: --format {as_format} writes one file, name it (e.g. out.{as_format})"
            )
        else:
            check_folder(directory.parent)
        with open_client() as ckpt, writing_into(directory):
            write = {"pt": pt.export_pt, "ckpt": lightning.export_ckpt, "trainer": trainer.export_trainer}[as_format]
            result = write(ckpt.transport, parsed.run_id, parsed.ref, directory)
    echo(
        f"exported {result.run_id}@{result.version} to {shown(str(directory))} as {as_format}: "
        f"{counted(result.tensors, 'tensor')}, {size(result.bytes)} in {result.seconds:.2f} s"
    )
    for name in result.files:
        echo(f"  {shown(name)}")


def _export_other(target: str, directory: Path, as_format: str, config: Path | None, keys: list[str] | None) -> None:
    """``export --format peft|dcp|accelerate`` (:mod:`client.formats.export_formats`,
    :mod:`client.formats.accelerate.export`)."""
    import json

    from ckptstore.client.formats.export_formats import export_dcp, export_peft

    with reported():
        parsed = parse_target(target)
        check_folder(directory)
        with open_client() as ckpt, writing_into(directory):
            if as_format == "peft":
                settings = json.loads(config.read_text(encoding="utf-8")) if config is not None else None
                result = export_peft(ckpt.transport, parsed.run_id, parsed.ref, directory, config=settings, keys=keys)
            elif as_format == "dcp" and keys is None:
                result = export_dcp(ckpt.transport, parsed.run_id, parsed.ref, directory)
            elif as_format == "accelerate" and keys is None:
                from ckptstore.client.formats.accelerate.export import export_accelerate

                result = export_accelerate(ckpt.transport, parsed.run_id, parsed.ref, directory)
            else:
                raise UsageProblem(
                    f"--format {as_format!r}: use hf, peft, dcp or accelerate (dcp and accelerate take no --keys)"
                )
    written = shown(str(directory))
    echo(
        f"exported {result.run_id}@{result.version} to {written} as {as_format}: {counted(result.tensors, 'tensor')}, "
        f"{size(result.bytes)} in {result.seconds:.2f} s"
    )


def import_(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="DIR_OR_FILE",
            exists=True,
            help="A .safetensors, .pt, .pth, .bin or Lightning .ckpt file; a folder with model.safetensors"
            "[.index.json] or pytorch_model.bin; a Trainer checkpoint folder; a PEFT adapter folder; an "
            "Accelerate save_state folder; a DCP checkpoint folder (get_state_dict's, torchtitan's or torchtune's).",
        ),
    ],
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run to add the version to (created if new).")],
    tag: Annotated[list[str] | None, typer.Option("--tag", help="Tag the new version (repeatable).")] = None,
    allow_expanded: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Store expanded (stride-0) tensors of .pt files as full tensors, each up to SIZE (e.g. 1GiB).",
        ),
    ] = None,
    max_expansion: Annotated[
        float,
        typer.Option(
            metavar="N",
            help="Refuse a source that makes more than N times its own bytes in tensors (reused regions; default 4).",
        ),
    ] = 4.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Store a checkpoint from disk as a new version: weights (frozen unless the source has
    optimizer state for them), and optimizer, scheduler and trainer state where the source has them.
    Prints what it stored and, by key or file, what it left out (--json: the same for scripts).

    The source is untrusted input: pickled files are read by ckptstore's own allow-list reader
    (tensors, dicts, lists, numbers, strings; nothing is ever called), every file it names must
    be a regular file inside it, every tensor must fit the bytes behind it, and configs never
    run code. A refused source stores nothing and exits with 2. Seed a base model once; every
    fine-tune saved later stores only what differs from it.
    """
    from ckptstore.client.formats.importing import read_checkpoint, save_imported

    with reported(invalid_input=EXIT_USAGE):
        if "@" in run_id:
            raise UsageProblem(f"{run_id!r}: import adds the next version of a run; give RUN without @REF")
        validate_run_id(run_id)
        imported = read_checkpoint(
            source, expand_limit=parse_size(allow_expanded) if allow_expanded else 0, max_expansion=max_expansion
        )
        with open_saving_client() as ckpt:
            result = save_imported(ckpt, imported, source, run_id, tags=tag or ())
    report = imported.report()
    if as_json:
        echo_json({"run_id": result.run_id, "version": result.version, **report, "bytes": result.bytes_total})
        return
    echo(
        f"imported {counted(result.tensors_total, 'tensor')} ({size(result.bytes_total)}) from {shown(str(source))} as "
        f"{result.run_id}@{result.version}: {size(result.bytes_new)} new, {result.dedup_ratio:.1%} already stored, "
        f"in {result.seconds:.2f} s"
    )
    for line in import_lines(report):
        echo(line)


def import_lines(report: dict) -> list[str]:
    """What an import stored and, by key, what it left out, for people: one line each, every name
    from the source as :func:`client.cli.shown.shown` writes it."""
    stored = [f"model: {counted(report['model_tensors'], 'tensor')}"]
    if report["optimizer_parameters"] is not None:
        stored.append(f"optimizer: state of {counted(report['optimizer_parameters'], 'parameter')}")
    if report["scheduler"]:
        stored.append("scheduler")
    if report["step"] is not None:
        stored.append(f"step {report['step']}")
    if report["metrics"]:
        stored.append("metrics " + ", ".join(f"{shown(k)}={v:.6g}" for k, v in sorted(report["metrics"].items())))
    if report["extra"]:
        stored.append("extra " + ", ".join(shown(str(key)) for key in report["extra"]))
    lines = ["  stored: " + "; ".join(stored)]
    lines += [f"  left out: {shown(str(key))} ({shown(str(why))})" for key, why in report["left_out"].items()]
    return lines


def verify(
    target: Annotated[
        str | None, typer.Argument(metavar="RUN[@REF]", help="One version (default: every version of every run).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Re-read and re-hash every stored byte a version references (or every version's); exit 1 on any problem.

    Says which store it checked (a server's URL, or the database and blob store) and what:
    versions, tensors, distinct digests and bytes. --json prints ok, versions, tensors, digests,
    bytes, seconds, problems and store.
    """
    from ckptstore.client.loading.verify import every_version
    from ckptstore.client.loading.verify import verify as run_verify

    with reported():
        parsed = parse_target(target) if target is not None else None
        bar = _Bar("verify")
        try:
            with open_client() as ckpt:
                if parsed is not None:
                    versions: list[tuple[str, int | str]] = [(parsed.run_id, parsed.ref)]
                else:
                    versions = list(every_version(ckpt.transport))
                report = run_verify(
                    ckpt.transport, versions, on_bytes=bar.update, on_total=bar.total, strict_refs=parsed is not None
                )
                where = ckpt.transport.location
        finally:
            bar.close()
    if as_json:
        echo_json({**report.to_json(), "store": where})
    else:
        if report.problems:
            rows = [(f"{p.run_id}@{p.version or '?'}", p.key or "-", p.shard_id, p.problem) for p in report.problems]
            table(("VERSION", "KEY", "SHARD", "PROBLEM"), rows)
        echo(
            f"verified {counted(report.versions, 'version')}: {counted(report.tensors, 'tensor')}, "
            f"{report.digests} distinct, {size(report.bytes)} re-read and re-hashed in {report.seconds:.2f} s"
        )
        echo(f"store: {where}")
    if report.problems:
        echo(f"error: {counted(len(report.problems), 'problem')} found in stored tensors or metadata", err=True)
        raise typer.Exit(EXIT_FAILED)
