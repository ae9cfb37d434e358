"""What every ``ckptstore`` command shares: the client from the environment, RUN@REF targets,
error reporting, sizes and aligned tables, and :func:`echo`, through which every command prints
(control characters in what it prints written as escapes: :mod:`client.cli.shown`).

Torch-free at import, like every module of :mod:`client.cli`: the server image runs ``ckptstore
serve`` and ``ckptstore db`` without torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from ckptstore.client.cli.shown import shown, shown_lines
from ckptstore.service.errors import (
    CheckpointError,
    InvalidInputError,
    InvalidNameError,
    StorageFullError,
    is_disk_full,
)
from ckptstore.service.format.names import LATEST, parse_ref, validate_run_id
from ckptstore.service.secrets_mask import mask_urls

if TYPE_CHECKING:
    from ckptstore.client.api import Client
    from ckptstore.client.connection import Connection

#: Exit codes: 1 = the operation failed (or found problems), 2 = the command line was wrong.
EXIT_FAILED = 1
EXIT_USAGE = 2

#: How long a command keeps trying a server that has not answered yet (a mistyped or stopped
#: ``CKPTSTORE_URL``), unless ``CKPTSTORE_RETRY_SECONDS`` is set: a training job's client waits
#: the whole retry budget (60 s) to ride out a restart, a person at a prompt should not.
REACH_SECONDS = 5.0
#: How long a command waits for a server's answer to a metadata call (a listing, a manifest, a
#: tag): a server that accepts connections but never answers. Transfers keep their timeouts.
ANSWER_SECONDS = 10.0

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class UsageProblem(Exception):
    """The command line names something malformed (exit 2)."""


@dataclass(frozen=True)
class Target:
    """A parsed ``RUN[@REF]``."""

    run_id: str
    ref: int | str
    explicit: bool

    def __str__(self) -> str:
        return f"{self.run_id}@{self.ref}"


def parse_target(text: str, what: str = "RUN[@REF]") -> Target:
    """Split ``RUN@REF`` (REF = a version number, ``latest`` or a tag; absent = latest)."""
    run_id, sep, ref = text.partition("@")
    if sep and not ref:
        raise UsageProblem(f"{text!r}: nothing after '@'; write {what}, e.g. my-run@3, my-run@latest or my-run@best")
    try:
        validate_run_id(run_id)
        parsed = parse_ref(ref) if sep else LATEST
    except InvalidNameError as exc:
        raise UsageProblem(f"{text!r}: {exc}") from exc
    return Target(run_id, parsed, bool(sep))


def parse_size(text: str) -> int:
    """Bytes in ``500MB``, ``5GB`` (powers of 1000, as Hugging Face does), ``1GiB`` or ``1048576``."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageProblem(f"size {text!r}: write a number with an optional unit, e.g. 500MB, 5GB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageProblem(f"size {text!r} must be more than 0 bytes")
    return value


def echo(text: str = "", *, err: bool = False) -> None:
    """Print ``text`` on stdout (``err``: stderr), every control character in it but its newlines
    written as an escape (:func:`client.cli.shown.shown_lines`); every command prints through here."""
    typer.echo(shown_lines(text), err=err)


def error_line(message: str) -> str:
    """``error: message`` as one line: any URL with its secrets masked, every control character
    (newlines included) written as an escape."""
    return f"error: {shown(mask_urls(message))}"


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``error: message`` on stderr (:func:`error_line`) and exit with ``code``.

    Messages quote foreign text (S3's names its endpoint URL, credentials and all; an import's, the
    names of the files it was given).
    """
    typer.echo(error_line(message), err=True)
    raise typer.Exit(code)


@contextmanager
def reported(*, invalid_input: int = EXIT_FAILED) -> Iterator[None]:
    """Turn expected errors into ``error: …`` and an exit code, never a traceback.

    Malformed names are usage errors (2); a refused input is ``invalid_input`` (2 for a
    command whose input is a file the user named, such as ``import``); every other
    CheckpointError and file-system error means the operation failed (1).
    """
    try:
        yield
    except UsageProblem as exc:
        fail(str(exc), EXIT_USAGE)
    except InvalidNameError as exc:
        fail(str(exc), EXIT_USAGE)
    except InvalidInputError as exc:
        fail(str(exc), invalid_input)
    except CheckpointError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(os_problem(exc))


def os_problem(exc: OSError) -> str:
    """One line for a file-system error no layer below named: what failed, on which path, and
    for a full disk which folder and what to run, never a bare ``[Errno 28]``."""
    named = exc.filename2 if exc.filename2 is not None else exc.filename
    path = Path(os.fsdecode(named)) if isinstance(named, (str, bytes, os.PathLike)) else None
    if is_disk_full(exc):
        return StorageFullError.of_folder(path.parent if path is not None else "the store", exc.strerror or exc).message
    if exc.strerror is None:
        return str(exc) or type(exc).__name__
    return f"file-system error: {exc.strerror}" + (f" ({path})" if path is not None else "")


def check_folder(directory: Path) -> None:
    """Refuse a folder to write into that is a file, or lies under one, before any work is done.

    Raises:
        UsageProblem: ``directory`` or a folder above it exists and is not a folder.
    """
    for path in (directory, *directory.parents):
        if path.exists():  # the nearest that exists (following links) must be a folder
            if path.is_dir():
                return
            if path == directory:
                raise UsageProblem(
                    f"{directory} exists and is not a folder: name a folder to write into (made if absent)"
                )
            raise UsageProblem(
                f"{path} exists and is not a folder, so {directory} cannot be made in it: name another folder"
            )


def write_problem(exc: OSError, directory: Path) -> str | None:
    """One clear line for a file-system error writing into ``directory``; None when the error
    names no path in it or above it (the store's own files, say): that is reported as it is."""
    named = exc.filename2 if exc.filename2 is not None else exc.filename
    if named is None:
        return None
    path = Path(os.fsdecode(named))
    where, top = Path(os.path.abspath(path)), Path(os.path.abspath(directory))
    if not (where.is_relative_to(top) or top.is_relative_to(where)):
        return None
    if isinstance(exc, IsADirectoryError):
        return f"{path} exists and is a folder, so no file can be written there: move it away or write elsewhere"
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        return f"{path} exists and is not a folder: move it away or write into another folder"
    if isinstance(exc, PermissionError):
        return f"cannot write {path}: permission denied; write into a folder you may write to"
    return f"cannot write {path}: {exc.strerror or exc}"


@contextmanager
def writing_into(directory: Path) -> Iterator[None]:
    """Report a file-system error writing into ``directory`` as one clear line (exit 1): which
    path, what is wrong with it, and what to do, rather than ``[Errno 17] File exists: …``."""
    try:
        yield
    except OSError as exc:
        message = write_problem(exc, directory)
        if message is None:
            raise
        fail(message)


@contextmanager
def open_client(*, create: bool = False) -> Iterator[Connection]:
    """A connection to ``CKPTSTORE_URL`` (a server), or else to the store ``ckptstore serve``
    would open: ``CKPTSTORE_DATABASE_URL`` and ``CKPTSTORE_BLOBS`` when set, else the embedded
    store in ``CKPTSTORE_HOME``.

    The same settings :func:`client.default_client` reads, through a torch-free
    :class:`client.connection.Connection`: listing and managing versions never imports torch.
    The CLI opens its own connection and closes it so an HTTP client's upload staging folder
    does not outlive the command. Every command that may refuses a store that does not exist
    yet (NotFoundError naming the variables to set) rather than report on an empty one it just
    made; ``create=True`` is for a command that saves (see :func:`open_saving_client`).
    """
    from ckptstore.client.connection import Connection

    with Connection(server_url(), token=_token(), create=create) as opened:
        _impatient(opened)
        yield opened


@contextmanager
def open_saving_client() -> Iterator[Client]:
    """A :class:`client.api.Client` (which imports torch) on the same store as :func:`open_client`,
    creating the store if it does not exist yet: for the commands that save tensors."""
    from ckptstore.client.api import Client

    with Client(server_url(), token=_token(), create=True) as opened:
        _impatient(opened)
        yield opened


def _impatient(connection: Connection) -> None:
    """Make a server's client give up within seconds when the server cannot be reached or does
    not answer (:meth:`client.http.transport.HttpTransport.limit_waiting`); an embedded store has
    nothing to wait for. A ``CKPTSTORE_RETRY_SECONDS`` that is set still says how long to keep trying."""
    limit_waiting = getattr(connection.transport, "limit_waiting", None)
    if limit_waiting is None:
        return
    explicit = (os.environ.get("CKPTSTORE_RETRY_SECONDS") or "").strip()
    limit_waiting(reach_seconds=None if explicit else REACH_SECONDS, answer_seconds=ANSWER_SECONDS)


def server_url() -> str | None:
    return os.environ.get("CKPTSTORE_URL") or None


def _token() -> str | None:
    return os.environ.get("CKPTSTORE_TOKEN") or None


def echo_json(value: Any) -> None:
    """Print ``value`` as indented JSON on stdout (ASCII: every other character written as ``\\uXXXX``)."""
    echo(json.dumps(value, indent=2, ensure_ascii=True))


def size(n: int) -> str:
    """Bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = (), indent: str = ""
) -> None:
    """Print ``rows`` under ``headers`` in aligned columns; columns in ``right`` are right-aligned.

    A cell is one line, as :func:`client.cli.shown.shown` writes it (escapes counted in its width)."""
    cells = [[shown(str(c)) for c in headers]] + [["-" if c is None else shown(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        parts = [
            cell.rjust(width) if index in right else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        echo((indent + "  ".join(parts)).rstrip())
