"""Files a source names, resolved inside its folder and opened as regular files only.

A checkpoint folder names other files (an index's shards, DCP's ``relative_path``); every such
name is an attacker's string. :func:`inside` checks it is a plain relative name that resolves
under the folder; a symbolic link is followed only when it also ends inside the folder.

What is checked is not what is opened unless the open itself holds the rule: a folder inside the
source could be swapped for a link to elsewhere between the check and the open. So
:func:`open_regular` never opens by path. It walks from a descriptor of the folder being read
(:func:`reading`, opened once for the whole import), one component at a time, each opened
relative to its parent's descriptor with ``O_NOFOLLOW`` (folders with ``O_DIRECTORY`` too), so no
component is ever a link the kernel follows. A link met on the way is read (``readlinkat``), its
target checked against the rule, and the walk starts again from the folder's descriptor, at most
:data:`MAX_LINKS` times. The file is opened without blocking (a FIFO must not hang the import),
then anything but a regular file is refused. :func:`map_file` maps one read-only, so pages come
from the page cache as they are used and a region is checked against the file's size first.

One layout widens the fence: a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``),
whose files are links into ``<repo>/blobs``; within :func:`links_within` (or a :func:`reading` of
such a snapshot) its links may resolve anywhere inside the repo folder, and nowhere else.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.service.errors import InvalidInputError

#: Most links one open may follow (the kernel's own bound on a path's links).
MAX_LINKS = 40
#: A folder on the way: never a link, never opened for reading (search permission is enough).
_FOLDER = os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
#: The file itself: never a link, never blocking (a FIFO's open would wait for a writer).
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

_opened: ContextVar[set[Path] | None] = ContextVar("ckptstore_opened_files", default=None)
#: A folder above the source that its links may also resolve into (a Hugging Face cache repo).
_wider: ContextVar[Path | None] = ContextVar("ckptstore_link_root", default=None)


@dataclass(frozen=True)
class _Fence:
    """Where a walk starts and what it may reach: ``top`` (the folder, or the cache repo above it),
    held open as ``top_fd``, and its links resolved (``top_real``, what an absolute link's target
    is compared with); ``root`` is the folder being read, named in refusals."""

    root: Path
    top: Path
    top_fd: int

    @classmethod
    def open(cls, root: Path, top: Path) -> _Fence:
        """The fence of ``root`` under ``top``, ``top`` opened (following links: the caller's choice).

        Raises:
            OSError: ``top`` cannot be opened as a folder.
        """
        flags = os.O_DIRECTORY | getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
        return cls(root, top, os.open(top, flags))

    @property
    def top_real(self) -> Path:
        return Path(os.path.realpath(self.top))


_fence: ContextVar[_Fence | None] = ContextVar("ckptstore_read_folder", default=None)


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


def _fence_for(root: Path, wider: Path | None) -> tuple[Path, Path]:
    """``(root, top)`` as absolute paths: ``top`` is ``wider`` when ``root`` lies inside it."""
    root = Path(os.path.abspath(root))
    if wider is not None:
        wider = Path(os.path.abspath(wider))
        if wider in root.parents:
            return root, wider
    return root, root


@contextmanager
def reading(root: Path, wider: Path | None = None) -> Iterator[None]:
    """In this context every :func:`open_regular` of a path under ``root`` walks from one descriptor
    of ``root`` (of ``wider``, the cache repo above a snapshot, whose links may resolve anywhere in
    it), opened here once: a folder of the source swapped for a link meanwhile is never followed.

    Raises:
        OSError: ``root`` cannot be opened as a folder.
    """
    fence = _Fence.open(*_fence_for(root, wider))
    token, wide = _fence.set(fence), _wider.set(fence.top if fence.top != fence.root else None)
    try:
        yield
    finally:
        _wider.reset(wide)
        _fence.reset(token)
        os.close(fence.top_fd)


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

    A check of the name and of where it resolves now; :func:`open_regular` holds the same rule
    when it opens the file.

    Raises:
        InvalidInputError: ``name`` is not a string, is absolute, climbs out (``..``) or
            resolves outside ``root``.
    """
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise InvalidInputError(
            f"{named_in}: {shown(name, 120)} is not a plain file name; a source names only its own files, "
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


def _normal(parts: list[str]) -> list[str] | None:
    """``parts`` with ``.`` and ``..`` taken out (each ``..`` removing the part before it), or None
    when a ``..`` climbs above the first. Lexical, and right here: every folder a walk has passed is
    a real folder, never a link."""
    kept: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if not kept:
                return None
            kept.pop()
        else:
            kept.append(part)
    return kept


def _retarget(fence: _Fence, before: list[str], target: str, after: list[str], path: Path, link: str) -> list[str]:
    """The parts (under ``fence.top``) a walk takes next, a link at ``before + [link]`` read as
    ``target``; refused unless they lead somewhere inside the fence.

    Raises:
        InvalidInputError: the target leads outside the fence (or to the fence itself).
    """
    inward: list[str] | None
    if os.path.isabs(target):
        # Where an absolute target leads, found by path: whatever it names, the walk that follows
        # checks every component again from the fence's descriptor.
        parts = _normal([*PurePosixPath(os.path.realpath(target)).parts[1:], *after])
        top = PurePosixPath(fence.top_real).parts[1:]
        inward = parts[len(top) :] if parts is not None and tuple(parts[: len(top)]) == top else None
    else:
        inward = _normal([*before, *PurePosixPath(target).parts, *after])
    if not inward:
        raise InvalidInputError(f"{path}: {link[:120]!r} is a link that points outside {fence.root}")
    return inward


def _link_at(parent: int, name: str) -> str | None:
    """The target of the link ``name`` in the folder ``parent``, or None when it is no link (now)."""
    try:
        return os.readlink(name, dir_fd=parent)
    except OSError:
        return None


def _changed(parent: int, name: str) -> bool:
    """Whether ``name`` in ``parent`` is a folder or a link: one that failed to open as a folder was
    swapped meanwhile, not a file named as a folder."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) or stat.S_ISLNK(mode)


def _open_walking(fence: _Fence, parts: list[str], path: Path) -> int:
    """A descriptor of the file at ``parts`` under ``fence.top_fd``, every component opened with
    ``O_NOFOLLOW`` from its parent's descriptor. A link met is read and the walk starts again from
    the top (:func:`_retarget`); so does one whose component changed while it was opened; at most
    :data:`MAX_LINKS` times.

    Raises:
        InvalidInputError: a link leads outside, or the walk starts again more than :data:`MAX_LINKS` times.
        OSError: a component is missing or not a folder (``path`` named).
    """
    for _ in range(MAX_LINKS + 1):
        parent, owned = fence.top_fd, -1
        try:
            for index, name in enumerate(parts):
                last = index == len(parts) - 1
                try:
                    fd = os.open(name, _FILE if last else _FOLDER, dir_fd=parent)
                except OSError as exc:
                    failed = OSError(exc.errno, exc.strerror, str(path))
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise failed from None
                    target = _link_at(parent, name)
                    if target is not None:
                        parts = _retarget(fence, parts[:index], target, parts[index + 1 :], path, name)
                    elif exc.errno == errno.ENOTDIR and not _changed(parent, name):
                        raise failed from None
                    break  # walk again from the top
                if last:
                    return fd
                if owned >= 0:
                    os.close(owned)
                parent = owned = fd
        finally:
            if owned >= 0:
                os.close(owned)
    raise InvalidInputError(
        f"{path}: more than {MAX_LINKS} links (or changes while it was opened) on the way, past the limit"
    )


def _walk_from(path: Path) -> tuple[_Fence, list[str], bool]:
    """The fence a walk to ``path`` starts from and the parts under it: the folder being read
    (:func:`reading`), else ``path``'s own folder (``owned``: its descriptor is the caller's to close).

    Raises:
        InvalidInputError: ``path`` lies outside the folder being read.
    """
    absolute = Path(os.path.abspath(path))
    fence = _fence.get()
    if fence is not None:
        if absolute == fence.top:
            raise InvalidInputError(f"{path}: not a regular file; ckptstore reads checkpoints from regular files only")
        if fence.top not in absolute.parents:
            raise InvalidInputError(f"{path} lies outside {fence.root}, the folder being read")
        return fence, list(absolute.relative_to(fence.top).parts), False
    fence = _Fence.open(*_fence_for(absolute.parent, _wider.get()))  # the file's own folder, as named
    return fence, list(absolute.relative_to(fence.top).parts), True


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, a regular file (never a FIFO, device or socket).

    Opened by walking from the folder being read (:func:`reading`; else from ``path``'s own
    folder), no component followed as a link: a link met is followed only when its target stays
    inside that folder (or the cache repo :func:`links_within` names). ``O_NONBLOCK`` keeps a FIFO
    from blocking the open itself.

    Raises:
        InvalidInputError: not a regular file, or a link out of its folder.
        OSError: the file cannot be opened.
    """
    opened = _opened.get()
    if opened is not None:
        opened.add(path)
    fence, parts, owned = _walk_from(path)
    try:
        fd = _open_walking(fence, parts, path)
    finally:
        if owned:
            os.close(fence.top_fd)
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
