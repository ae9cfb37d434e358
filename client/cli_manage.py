"""``ckptstore tag``, ``untag``, ``rm`` and ``gc``: naming, deleting and reclaiming versions."""

from __future__ import annotations

from typing import Annotated

import typer

from client.cli_common import EXIT_USAGE, fail, open_client, parse_target, reported
from service.format.names import validate_run_id, validate_tag

GC_UNAVAILABLE = (
    "garbage collection is not available yet: finding the shards no version references needs the "
    "store to list every shard it holds, which no store operation offers yet (it comes with "
    "server-side collection). Deleted versions' bytes stay stored until then; nothing was changed"
)


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
    typer.echo(f"{parsed.run_id}@{name} -> version {version}")


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
    typer.echo(f"removed tag {name} from {run_id}")


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
                typer.confirm(f"Delete version {version} of run {parsed.run_id!r}? This cannot be undone", abort=True)
            ckpt.delete(parsed.run_id, version)
    typer.echo(
        f"deleted {parsed.run_id}@{version}; shards only it referenced stay stored until `ckptstore gc` reclaims them"
    )


def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be reclaimed.")] = False,
) -> None:
    """Reclaim shards that no committed version references (not available yet)."""
    fail(GC_UNAVAILABLE, EXIT_USAGE)
