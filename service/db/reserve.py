"""A reserve of disk space for cleanup: a file of real blocks beside a SQLite metadata database.

SQLite needs free space to delete rows (the write-ahead log takes a frame for each page it
changes) and even to read (its shared-memory file, ``-shm``, is made when a process opens the
database). A disk that saves filled to its last byte would leave ``ckptstore rm`` and ``gc``
unable to run, and nothing inside the store could be freed. So a store whose metadata database
is a SQLite file keeps ``reserve`` in that file's folder, of ``CKPTSTORE_RESERVE_BYTES`` (64 MiB
unless set: room for SQLite to delete the rows of many versions; 0: none):

- **Made** with real blocks (never a sparse file) whenever it is absent and the disk has twice
  its size free, so making it leaves saves as much again: when the store opens, before each
  shard is written, and after each cleanup.
- **Never used by saves.** While it is absent and cannot be made, a shard write is refused with
  :class:`~service.errors.StorageFullError`: the room it left stays for cleanup.
- **Released to cleanup** (deleting a version, removing a tag, applying retention, ``gc``) when
  the disk has less free than its size, or when the cleanup meets a full disk (which then runs
  once more): :meth:`SpaceReserve.cleanup`.
- **Released on opening** a store whose disk has less than :data:`OPEN_ROOM` free, so SQLite
  can open its shared-memory file and the cleanup that follows can run.

Several processes may share one store: the file itself is the state, made under a temporary
name and renamed into place, so a reserve is whole or absent.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ckptstore.service.errors import FREE_SPACE, StorageFullError

#: The reserve's file name, in the folder of the metadata database.
RESERVE_FILE = "reserve"
#: Below this much free space a store being opened releases its reserve: SQLite needs room for
#: its shared-memory file (32 KiB) before it can read anything.
OPEN_ROOM = 1 << 20
#: What to do when even the reserve did not make room.
FREE_OUTSIDE = (
    "the store's reserve is spent; delete or move a file outside the store on that disk (or grow it), "
    "then run `ckptstore rm RUN@VERSION` and `ckptstore gc`"
)
_CHUNK_BYTES = 1 << 20

T = TypeVar("T")

#: Reserves a cleanup of this process is using (by path): none is made again meanwhile.
_lent: dict[Path, int] = {}
_lent_lock = threading.Lock()


def sqlite_folder(url: str) -> Path | None:
    """The folder of the SQLite file that database URL ``url`` names; None for another database
    or one held in memory."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    if str(parsed.database).startswith("file:"):
        return None  # a URI filename (``mode=memory`` and the like): no folder of its own to count on
    return Path(str(parsed.database)).expanduser().absolute().parent


class SpaceReserve:
    """The reserve of ``size`` bytes in ``folder`` (the metadata database's), for cleanup only.

    Args:
        folder: the folder of the SQLite metadata database (it exists).
        size: the reserve's size in bytes (above 0).
    """

    def __init__(self, folder: Path, size: int) -> None:
        if size <= 0:
            raise ValueError(f"a reserve of {size} bytes keeps nothing; pass None for no reserve")
        self.folder = Path(folder)
        self.size = size
        self.path = self.folder / RESERVE_FILE

    @classmethod
    def for_database(cls, url: str, size: int) -> SpaceReserve | None:
        """The reserve of the database at ``url``: None unless it is a SQLite file and ``size`` is above 0."""
        folder = sqlite_folder(url)
        return cls(folder, size) if folder is not None and size > 0 else None

    @classmethod
    def opening(cls, folder: Path, size: int) -> SpaceReserve | None:
        """The reserve of a SQLite database in ``folder`` whose store is opening (:meth:`on_opening`
        done); None for ``size`` 0."""
        if size <= 0:
            return None
        reserve = cls(folder, size)
        reserve.on_opening()
        return reserve

    # -- the state -----------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Bytes free for this process on the folder's disk (``df``'s "Available")."""
        stats = os.statvfs(self.folder)
        return stats.f_bavail * stats.f_frsize

    @property
    def held(self) -> bool:
        """Whether the reserve file is in place."""
        return self.path.is_file()

    def make_if_room(self) -> bool:
        """Make the reserve unless it is held, a cleanup of this process is using it, or the disk
        has less than twice its size free; whether it is held now.

        A reserve that cannot be made (a read-only folder, a disk that filled meanwhile) is
        simply not made: it is tried again at the next chance.
        """
        if self.held:
            return True
        with _lent_lock:
            if _lent.get(self.path):
                return False
        try:
            if self.free_bytes() < 2 * self.size:
                return False
            self._write()
        except OSError:
            return False
        return True

    def release(self) -> int:
        """Delete the reserve, giving its space to the disk; the bytes released (0 if it was not held)."""
        try:
            size = self.path.stat().st_size
            self.path.unlink()
        except FileNotFoundError:
            return 0
        return size

    # -- the moments it matters ------------------------------------------------------------

    def on_opening(self) -> None:
        """Before the database is opened: release the reserve if the disk has less than
        :data:`OPEN_ROOM` free (else SQLite could not even read), or make it if there is room."""
        try:
            if self.free_bytes() < OPEN_ROOM:
                self.release()
                return
        except OSError:
            return  # a folder not made yet: opening the database makes it, and the next chance the reserve
        self.make_if_room()

    def check_room_for_writes(self) -> None:
        """Before a shard is written: refuse it while the reserve is absent and cannot be made
        for want of space, so saves never take the room cleanup needs.

        Raises:
            StorageFullError: the disk has less than twice the reserve free and no reserve.
        """
        if self.make_if_room():
            return
        try:
            free = self.free_bytes()
        except OSError:
            return  # the write itself reports what is wrong with the folder
        if free >= 2 * self.size:
            return  # absent for another reason (a cleanup running, a read-only folder): not for space
        raise StorageFullError(
            f"the disk holding {self.folder} is full: {free} bytes are free, less than twice the {self.size} "
            f"bytes the store keeps in reserve for its cleanup (CKPTSTORE_RESERVE_BYTES; 0 keeps none); "
            f"nothing was stored: {FREE_SPACE}"
        )

    def cleanup(self, work: Callable[[], T]) -> T:
        """Run ``work`` (a cleanup, safe to run twice: each try is its own transactions) with the
        reserve's room: released up front when the disk has less free than the reserve's size, or
        when ``work`` meets a full disk, which then runs once more. The reserve is made again
        afterwards if there is room.

        Raises:
            StorageFullError: the disk is full even with the reserve released (or none was held).
        """
        with self._lent():
            if self.held and self.free_bytes() < self.size:
                self.release()
            try:
                result = work()
            except StorageFullError as exc:
                if not self.release():
                    raise StorageFullError.of_folder(self.folder, exc.message, fix=FREE_OUTSIDE) from exc
                try:
                    result = work()
                except StorageFullError as again:
                    raise StorageFullError.of_folder(self.folder, again.message, fix=FREE_OUTSIDE) from again
        self.make_if_room()
        return result

    @contextmanager
    def _lent(self) -> Iterator[None]:
        """While a cleanup runs in this process: the reserve is not made again under it."""
        with _lent_lock:
            _lent[self.path] = _lent.get(self.path, 0) + 1
        try:
            yield
        finally:
            with _lent_lock:
                _lent[self.path] -= 1
                if not _lent[self.path]:
                    del _lent[self.path]

    def _write(self) -> None:
        """Write the reserve under a temporary name with every block allocated, then rename it in."""
        temporary = self.folder / f"{RESERVE_FILE}.{os.getpid()}.{threading.get_ident()}.incomplete"
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _allocate(descriptor, self.size)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(temporary, self.path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def cleanup_with(reserve: SpaceReserve | None, work: Callable[[], T]) -> T:
    """``work``, a cleanup, run with the room of ``reserve`` (:meth:`SpaceReserve.cleanup`), or as it is without one."""
    return work() if reserve is None else reserve.cleanup(work)


def _allocate(descriptor: int, size: int) -> None:
    """Give the file ``size`` bytes of real blocks: allocated by the file system where it can, else
    written with bytes no file system compresses away (zeros would be, or left as holes)."""
    try:
        os.posix_fallocate(descriptor, 0, size)
        if os.fstat(descriptor).st_blocks * 512 >= size:
            return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    chunk = os.urandom(_CHUNK_BYTES)
    written = 0
    while written < size:
        written += os.pwrite(descriptor, chunk[: min(_CHUNK_BYTES, size - written)], written)


__all__ = ["OPEN_ROOM", "RESERVE_FILE", "SpaceReserve", "cleanup_with", "sqlite_folder"]
