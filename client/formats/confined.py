"""Files a source names, resolved inside its folder and opened as regular files only.

A checkpoint folder names other files (an index's shards, DCP's ``relative_path``); every such
name is an attacker's string. :func:`inside` resolves it and keeps it under the folder; a
symbolic link is followed only when it also ends inside the folder. :func:`open_regular`
opens without following a final link and without blocking (a FIFO must not hang the import),
then refuses anything but a regular file. :func:`map_file` maps one read-only, so pages come
from the page cache as they are used and a region is checked against the file's size first.

One layout widens the fence: a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``),
whose files are links into ``<repo>/blobs``; within :func:`links_within` its links may resolve
anywhere inside the repo folder, and nowhere else.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path, PurePosixPath

from service.errors import InvalidInputError

_opened: ContextVar[set[Path] | None] = ContextVar("ckptstore_opened_files", default=None)
#: A folder above the source that its links may also resolve into (a Hugging Face cache repo).
_wider: ContextVar[Path | None] = ContextVar("ckptstore_link_root", default=None)


def cache_repo(source: Path) -> Path | None:
    """The Hugging Face cache repo folder (``models--org--name``) of a snapshot folder, else None.

    The hub's cache keeps each file once in ``<repo>/blobs/`` and a snapshot's files are links
    to them (``snapshots/<revision>/model.safetensors -> ../../blobs/<sha256>``).
    """
    parent = source.parent
    if parent.name == "snapshots" and (parent.parent / "blobs").is_dir() and parent.parent.name.count("--") >= 1:
        return parent.parent.resolve()
    return None


@contextmanager
def links_within(root: Path | None) -> Iterator[None]:
    """In this context, links may also resolve anywhere inside ``root`` (None: only the folder itself)."""
    token = _wider.set(root)
    try:
        yield
    finally:
        _wider.reset(token)


@contextmanager
def recording() -> Iterator[set[Path]]:
    """A set that collects every path :func:`open_regular` opens in this context, as named
    (what an import read, so it can say which files of a folder it did not)."""
    opened: set[Path] = set()
    token = _opened.set(opened)
    try:
        yield opened
    finally:
        _opened.reset(token)


def inside(root: Path, name: object, *, named_in: str) -> Path:
    """The file ``name`` (relative to ``root``) names, once it is a plain relative path that
    resolves (links followed) to a place under ``root``.

    Raises:
        InvalidInputError: ``name`` is not a string, is absolute, climbs out (``..``) or
            resolves outside ``root``.
    """
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise InvalidInputError(
            f"{named_in}: {str(name)[:120]!r} is not a plain file name; a source names only its own files, "
            f"never a place outside {root}"
        )
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise InvalidInputError(f"{named_in}: {name[:120]!r} points outside {root}: a source names only its own files")
    base = root.resolve()
    resolved = (base / relative).resolve()
    if resolved != base and base not in resolved.parents:
        wider = _wider.get()
        if wider is None or wider not in resolved.parents or wider not in base.parents:
            raise InvalidInputError(f"{named_in}: {name[:120]!r} is a link that points outside {root}")
    return resolved


def confined_file(path: Path) -> Path:
    """``path`` itself when it is not a symbolic link leading out of its own folder.

    Raises:
        InvalidInputError: ``path`` is a link whose target lies outside ``path``'s folder.
    """
    if path.is_symlink():
        return inside(path.parent, path.name, named_in=str(path))
    return path


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, a regular file (never a FIFO, device or socket).

    A final symbolic link is refused unless it stays in the file's folder (then its target is
    opened); ``O_NONBLOCK`` keeps a FIFO from blocking the open itself.

    Raises:
        InvalidInputError: not a regular file, or a link out of its folder.
        OSError: the file cannot be opened.
    """
    target = confined_file(path)
    opened = _opened.get()
    if opened is not None:
        opened.add(path)
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidInputError(f"{path}: not a regular file; ckptstore reads checkpoints from regular files only")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_region(path: Path | str, offset: object, length: object, size: int, what: str) -> tuple[int, int]:
    """``(offset, length)`` once both are non-negative ints and the region lies inside ``size`` bytes.

    Raises:
        InvalidInputError: naming ``path``, ``what`` and the numbers.
    """
    if type(offset) is not int or type(length) is not int:
        raise InvalidInputError(f"{path}: {what} has an offset or length that is not an integer")
    if offset < 0 or length < 0:
        raise InvalidInputError(f"{path}: {what} has a negative offset or length ({offset}, {length})")
    if offset + length > size:
        raise InvalidInputError(
            f"{path}: {what} spans bytes {offset}-{offset + length}, past the end of the file ({size} bytes)"
        )
    return offset, length


def map_file(path: Path) -> mmap.mmap | None:
    """``path`` mapped copy-on-write (writable views, nothing written back), or None when empty.

    Raises:
        InvalidInputError: not a regular file (see :func:`open_regular`).
    """
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size == 0:
            return None
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def read_small(path: Path, limit: int) -> bytes:
    """All of ``path``, a regular file of at most ``limit`` bytes (a config, an index, a header).

    Raises:
        InvalidInputError: larger than ``limit`` or not a regular file.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InvalidInputError(f"{path}: {size} bytes is past the limit of {limit} for this file")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(limit + 1)[:limit]
    finally:
        os.close(fd)
