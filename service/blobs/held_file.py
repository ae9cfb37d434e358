"""Temporary files held by their writer, so that a sweep removes a killed writer's and never a live one's.

A writer creates its temporary file (``*.incomplete``) with ``O_CREAT | O_EXCL``
(:func:`hold_new`), takes an exclusive ``flock`` on it and keeps the lock until the file is
moved into place or removed (:meth:`HeldFile.remove`). The lock belongs to the open file, so
the kernel drops it when the process ends, however it ends: SIGKILL, a crash, a power cut.
A sweep (:func:`sweep_file`) opens a temporary file, tries the lock without waiting, and
removes the file only if it got the lock: then no live process is writing it, whatever its age.

One race is left by the order of creating and locking: a sweep may lock and remove a file
between its writer's ``open`` and ``flock``. The writer then holds a lock on a file with no
name (``fstat`` says ``st_nlink == 0``), and starts over under a fresh name.

Where the file system refuses ``flock`` (some network file systems), the writer goes on
without the lock and the sweep cannot judge the file (:attr:`Verdict.UNJUDGED`): the caller
falls back to the file's age. Locks are seen by processes of one host only: a staging folder
written by several hosts at once (over NFS) is not supported.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from enum import Enum
from pathlib import Path

#: The suffix of every temporary file a writer holds.
TEMP_SUFFIX = ".incomplete"
#: Fresh names tried when sweeps keep removing a new file before it is locked (one is plenty).
HOLD_ATTEMPTS = 8
#: Errors of ``flock`` meaning the file system cannot lock (not that another process holds it).
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL})


class HeldFile:
    """A temporary file this process holds an exclusive lock on, for as long as it writes it.

    Write it through a descriptor of your own (opened without ``O_CREAT | O_EXCL``: it exists);
    the lock stays with this object, also once the file is renamed into place, until
    :meth:`remove` or :meth:`release`. As a context manager it is removed on the way out.

    Attributes:
        path: the file's name in its folder.
        locked: whether the lock was taken (False on a file system that refuses ``flock``).
    """

    def __init__(self, path: Path, fd: int, *, locked: bool) -> None:
        self.path = path
        self.locked = locked
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (the file stays, if it is still there)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def remove(self) -> None:
        """Remove the file if it still has its name (a no-op once renamed away), then drop the lock."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.release()

    def __enter__(self) -> HeldFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def hold_new(path: Path | str) -> HeldFile:
    """Create ``path`` empty and hold it; under a fresh name in the same folder should a sweep
    remove it before it is locked.

    Raises OSError from the file system unchanged (EEXIST, ENOSPC, EACCES).
    """
    candidate = Path(path)
    for _ in range(HOLD_ATTEMPTS):
        fd = os.open(candidate, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            locked = _lock(fd)
            if not locked or os.fstat(fd).st_nlink > 0:
                return HeldFile(candidate, fd, locked=locked)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a sweep removed it between the open and the lock: a new name
        candidate = candidate.with_name(f"{uuid.uuid4().hex}{TEMP_SUFFIX}")
    raise OSError(errno.EAGAIN, f"temporary files in {candidate.parent} kept being removed as they were made")


def _lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd``, waiting (only a sweep holds it, for a moment); False
    where the file system cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return False
        raise
    return True


class Verdict(Enum):
    """What :func:`sweep_file` found."""

    REMOVED = "removed"  # nobody held it: removed (or, on a dry run, would be)
    IN_USE = "in use"  # a live process holds it
    GONE = "gone"  # removed meanwhile (by its writer, or by another sweep)
    UNJUDGED = "unjudged"  # the file system cannot lock: the caller judges by age


def sweep_file(path: Path | str, *, remove: bool = True) -> tuple[Verdict, int]:
    """Remove the temporary file at ``path`` unless a live process holds it; the verdict and its size.

    The file is removed while this sweep holds its lock, so a writer that locks it after
    finds it unlinked and starts over (see :func:`hold_new`). A symlink is never followed.
    With ``remove=False`` nothing is removed (a dry run). Raises OSError where the file
    cannot be opened or removed (permissions).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return Verdict.GONE, 0
    try:
        stat = os.fstat(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Verdict.IN_USE, stat.st_size
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                return Verdict.UNJUDGED, stat.st_size
            raise
        stat = os.fstat(fd)  # as it is now that nobody else can hold it
        if stat.st_nlink == 0:
            return Verdict.GONE, 0
        if remove:
            try:
                named = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return Verdict.GONE, 0
            if (named.st_dev, named.st_ino) != (stat.st_dev, stat.st_ino):
                return Verdict.GONE, 0  # the name now belongs to another file: left to a later sweep
            os.unlink(path)
        return Verdict.REMOVED, stat.st_size
    finally:
        os.close(fd)  # releases the lock, after the unlink


__all__ = ["HOLD_ATTEMPTS", "TEMP_SUFFIX", "HeldFile", "Verdict", "hold_new", "sweep_file"]
