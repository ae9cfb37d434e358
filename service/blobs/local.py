"""A BlobStore in a local folder: ``<root>/<ab>/<shard id>``, write-once, crash-safe."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptstore.service.blobs.base import BlobStore, check_blob_id, flat_bytes
from ckptstore.service.blobs.held_file import hold_new
from ckptstore.service.errors import IntegrityError, NotFoundError, StorageError, StorageFullError, is_disk_full
from ckptstore.service.format.digest import is_digest

#: Most buffers one ``preadv`` call takes (the kernel's IOV_MAX on Linux).
_IOV_MAX = 1024


def fsync_directory(path: Path) -> None:
    """Make a rename or file creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """The buffers still to fill after ``count`` more bytes arrived."""
    index = 0
    while index < len(buffers) and count >= buffers[index].nbytes:
        count -= buffers[index].nbytes
        index += 1
    rest = buffers[index:]
    if count:
        rest[0] = rest[0][count:]
    return rest


class LocalBlobStore(BlobStore):
    """Blobs as files fanned out by the first two hex characters of their id.

    A blob is moved in with ``os.replace`` after its bytes are fsynced, and the directory is
    fsynced after, so a crash leaves either no blob or the whole blob under its name.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._incoming = self.root / ".incoming"
        self._incoming.mkdir(exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    @property
    def location(self) -> str:
        """The folder as a ``file://`` URL."""
        return self.root.absolute().as_uri()

    def _path(self, blob_id: str) -> Path:
        check_blob_id(blob_id)
        return self.root / blob_id[:2] / blob_id

    def put_file(self, blob_id: str, path: Path) -> None:
        """Move (or, across file systems, copy) ``path`` into place under ``blob_id``."""
        target = self._path(blob_id)
        try:
            if target.exists():
                # Perhaps left by a put whose directory fsync failed (it raised, so nothing recorded
                # the blob): make its name durable before a retry records it.
                fsync_directory(target.parent)
                return
            if not target.parent.is_dir():
                target.parent.mkdir(exist_ok=True)
                fsync_directory(self.root)  # the new fan-out folder must survive a power cut too
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
            try:
                os.replace(path, target)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                self._copy_in(Path(path), target)
            fsync_directory(target.parent)
        except OSError as exc:
            if is_disk_full(exc):  # the copy across file systems, or a new fan-out folder's block
                raise StorageFullError.of_folder(self.root, f"{exc.strerror or exc} storing blob {blob_id}") from exc
            raise StorageError(f"could not store blob {blob_id} in {self.root}: {exc.strerror or exc}") from exc

    def _copy_in(self, source: Path, target: Path) -> None:
        # Held while copied, so a sweep of .incoming (service.reclaim.cleanup) leaves it be.
        with hold_new(self._incoming / f"{target.name}.{uuid.uuid4().hex}.incomplete") as temporary:
            with open(source, "rb") as src, open(temporary.path, "wb") as dst:
                shutil.copyfileobj(src, dst, 4 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(temporary.path, target)

    def size(self, blob_id: str) -> int | None:
        """Size of the blob's file, or None."""
        try:
            return self._path(blob_id).stat().st_size
        except FileNotFoundError:
            return None

    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        """Read the range with positional reads into ``buffer``."""
        self.read_scatter(blob_id, offset, [buffer])

    def read_scatter(self, blob_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn from ``offset`` with vectored positional reads (``preadv``)."""
        fd = self._open(blob_id, offset)
        try:
            self._preadv_all(fd, blob_id, offset, [flat_bytes(b) for b in buffers if b.nbytes])
        finally:
            os.close(fd)

    def open_file(self, blob_id: str) -> int:
        """A read-only descriptor of the blob's file (the caller closes it).

        Raises:
            NotFoundError: the blob is absent.
            StorageError: the file cannot be opened.
        """
        return self._open(blob_id, 0)

    def will_read(self, blob_id: str, spans: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to start reading the spans into the page cache (``POSIX_FADV_WILLNEED``):
        the reads that follow find them there, and the disk serves several at once meanwhile.
        Errors are ignored: the read itself reports them. Where the system has no such advice
        (macOS), nothing is done."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self._path(blob_id), os.O_RDONLY)
        except (OSError, ValueError):
            return
        try:
            for offset, length in spans:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _open(self, blob_id: str, offset: int) -> int:
        """A read-only descriptor of the blob's file (the caller closes it)."""
        path = self._path(blob_id)
        if offset < 0:
            raise ValueError(f"offset {offset} is negative")
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise NotFoundError(f"blob {blob_id} is missing from {self.root}") from exc
        except OSError as exc:
            raise StorageError(f"could not open blob {blob_id} in {self.root}: {exc.strerror or exc}") from exc

    def _preadv_all(self, fd: int, blob_id: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill every buffer, resuming after short reads (which may stop inside any buffer)."""
        done = 0
        expected = sum(buffer.nbytes for buffer in buffers)
        try:
            while buffers:
                count = os.preadv(fd, buffers[:_IOV_MAX], offset + done)
                if count == 0:
                    raise IntegrityError(f"blob {blob_id} ends before byte {offset + expected}; it was truncated")
                done += count
                buffers = _advance(buffers, count)
        except OSError as exc:  # EIO from a failing disk, ECONNRESET from a network file system
            raise StorageError(
                f"reading blob {blob_id} in {self.root} failed at byte {offset + done}: {exc.strerror or exc}; "
                "retry, and check the disk if it persists"
            ) from exc

    def delete(self, blob_id: str) -> None:
        """Remove the blob's file."""
        self._path(blob_id).unlink(missing_ok=True)

    def list_ids(self) -> Iterator[str]:
        """Every blob file under the fan-out folders."""
        for folder in sorted(self.root.iterdir()):
            if folder.is_dir() and len(folder.name) == 2:
                for entry in sorted(folder.iterdir()):
                    if is_digest(entry.name) and entry.name[:2] == folder.name:
                        yield entry.name
