"""Fault injection for blob stores and the server's staging folder, used only in tests.

:class:`FaultyBlobStore` wraps any :class:`BlobStore` and, once armed, makes the next call of
one operation fail at a chosen point *inside* the wrapped backend, where a real failure comes
from, so a test exercises the backend's own clean-up and error translation, not a stand-in:

    point          operation  backend  what fails
    copy-write     put_file   local    the copy into ``.incoming`` (the move in crossed a file
                                       system), once half the bytes are on disk: ENOSPC
    fsync-file     put_file   local    the fsync of the blob's bytes before it is moved in
    fsync-dir      put_file   local    the fsync of its fan-out folder after it is moved in
    pread          read_into  local    a positional read, after half the buffer is filled
    upload-part    put_file   s3       UploadPart of part 2 of a multipart upload
    get-body       read_into  s3       the GET's body stream, after the first piece: the error
                                       is wrapped the way urllib3 reports a reset socket

A fault fires once, in the first call that reaches its point; afterwards the wrapper is
healthy, so the test's retry is the retry "without the fault". ``fired`` counts the faults
that fired: tests assert it, so a fault that was never reached cannot pass vacuously. Patches
live only while the wrapper's own call runs, and only in the backend's module (or on the S3
client's event hooks), never in the ``os`` module every thread shares.

:func:`fail_staging_writes` breaks the server's staging folder the same way: the disk fills up
while an upload is being written, before anything reaches the blob store.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from urllib3.exceptions import ProtocolError

import ckptstore.service.blobs.local as local_module
from ckptstore.service.blobs import BlobStore, LocalBlobStore
from ckptstore.service.blobs.s3 import S3BlobStore

#: point -> (the wrapper operation it fails, the backend class it needs)
POINTS: dict[str, tuple[str, type[BlobStore]]] = {
    "copy-write": ("put_file", LocalBlobStore),
    "fsync-file": ("put_file", LocalBlobStore),
    "fsync-dir": ("put_file", LocalBlobStore),
    "pread": ("read_into", LocalBlobStore),
    "upload-part": ("put_file", S3BlobStore),
    "get-body": ("read_into", S3BlobStore),
}


def os_error(code: int) -> OSError:
    """The OSError the kernel reports for ``code`` (ENOSPC, EIO, ECONNRESET, …), as its subclass."""
    return OSError(code, os.strerror(code))


class _Overlay:
    """A module with a few attributes replaced; every other attribute is the module's own."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module = module
        vars(self).update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _ResettingStream:
    """A urllib3 response whose second read fails as a reset connection does."""

    def __init__(self, raw: Any, reset: Callable[[], BaseException]) -> None:
        self._raw = raw
        self._reset = reset
        self._reads = 0

    def read(self, amount: int | None = None) -> bytes:
        self._reads += 1
        if self._reads == 1:
            return bytes(self._raw.read(max(1, (amount or 2) // 2)))
        cause = self._reset()
        raise ProtocolError(f"Connection broken: {cause!r}", cause)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class FaultyBlobStore(BlobStore):
    """``inner`` with one armed fault at a time (see the module docstring for the points).

    Attributes:
        inner: the wrapped store; tests inspect it to see what really is stored.
        fired: how many armed faults have fired.
        partial_files: ``(path, bytes on disk)`` of each temporary file a fault cut short,
            recorded the moment it failed, so a test can prove it existed and is gone.
    """

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.fired = 0
        self.partial_files: list[tuple[Path, int]] = []
        self._armed: tuple[str, BaseException] | None = None

    def __repr__(self) -> str:
        return f"FaultyBlobStore({self.inner!r})"

    def arm(self, point: str, error: BaseException) -> None:
        """Make the next call that reaches ``point`` raise ``error`` (once)."""
        _operation, backend = POINTS[point]
        if not isinstance(self.inner, backend):
            raise TypeError(f"fault point {point!r} needs a {backend.__name__}, not {type(self.inner).__name__}")
        self._armed = (point, error)

    def _pending(self, point: str) -> bool:
        return self._armed is not None and self._armed[0] == point

    def _fire(self) -> BaseException:
        assert self._armed is not None, "a fault fired twice"
        error = self._armed[1]
        self._armed = None
        self.fired += 1
        return error

    @contextmanager
    def _faults_for(self, operation: str) -> Iterator[None]:
        """Install the armed fault's patches while ``operation`` runs, if it is that operation's."""
        if self._armed is None or POINTS[self._armed[0]][0] != operation:
            yield
            return
        point = self._armed[0]
        with pytest.MonkeyPatch.context() as patch, ExitStack() as hooks:
            if isinstance(self.inner, LocalBlobStore):
                self._patch_local(patch, point, self.inner)
            else:
                assert isinstance(self.inner, S3BlobStore)
                self._hook_s3(hooks, point, self.inner)
            yield

    def _patch_local(self, patch: pytest.MonkeyPatch, point: str, store: LocalBlobStore) -> None:
        real_os = local_module.os
        if point == "copy-write":

            def replace(source: Any, target: Any) -> None:
                if Path(source).parent != store.root / ".incoming":  # the move in from staging
                    raise os_error(errno.EXDEV)
                real_os.replace(source, target)

            def copyfileobj(source: BinaryIO, target: BinaryIO, length: int = 0) -> None:
                data = source.read()
                target.write(data[: len(data) // 2])
                target.flush()
                name = Path(str(target.name))
                self.partial_files.append((name, name.stat().st_size))
                raise self._fire()

            patch.setattr(local_module, "os", _Overlay(real_os, replace=replace))
            patch.setattr(local_module, "shutil", _Overlay(shutil, copyfileobj=copyfileobj))
        elif point in ("fsync-file", "fsync-dir"):
            root = real_os.stat(store.root)
            root_id = (root.st_dev, root.st_ino)

            def fsync(fd: int) -> None:
                found = real_os.fstat(fd)
                if point == "fsync-dir":  # a fan-out folder, not the root (fsynced for a new folder)
                    wanted = stat.S_ISDIR(found.st_mode) and (found.st_dev, found.st_ino) != root_id
                else:
                    wanted = stat.S_ISREG(found.st_mode)
                if self._pending(point) and wanted:
                    raise self._fire()
                real_os.fsync(fd)

            patch.setattr(local_module, "os", _Overlay(real_os, fsync=fsync))
        elif point == "pread":
            calls = 0

            def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
                nonlocal calls
                calls += 1
                (view,) = buffers
                if calls == 1 and len(view) > 1:  # part of the range arrives, then the read fails
                    return real_os.preadv(fd, [view[: len(view) // 2]], offset)
                if self._pending(point):
                    raise self._fire()
                return real_os.preadv(fd, buffers, offset)

            patch.setattr(local_module, "os", _Overlay(real_os, preadv=preadv))
        else:
            raise AssertionError(point)

    def _hook_s3(self, hooks: ExitStack, point: str, store: S3BlobStore) -> None:
        events = store.client.meta.events
        if point == "upload-part":
            event = "before-parameter-build.s3.UploadPart"

            def fail_part(params: dict[str, Any], **_: Any) -> None:
                if params.get("PartNumber") == 2 and self._pending(point):
                    raise self._fire()

            handler: Callable[..., None] = fail_part
        elif point == "get-body":
            event = "after-call.s3.GetObject"

            def break_body(parsed: dict[str, Any], **_: Any) -> None:
                if self._pending(point) and "Body" in parsed:
                    body = parsed["Body"]
                    body._raw_stream = _ResettingStream(body._raw_stream, self._fire)

            handler = break_body
        else:
            raise AssertionError(point)
        events.register(event, handler)
        hooks.callback(events.unregister, event, handler)

    # -- the BlobStore interface -----------------------------------------------------------

    def put_file(self, blob_id: str, path: Path) -> None:
        """The inner store's put, with a put_file fault if one is armed."""
        with self._faults_for("put_file"):
            self.inner.put_file(blob_id, path)

    def size(self, blob_id: str) -> int | None:
        """The inner store's answer."""
        return self.inner.size(blob_id)

    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        """The inner store's read, with a read_into fault if one is armed.

        :meth:`iter_range` is the base class's, which reads through this method.
        """
        with self._faults_for("read_into"):
            self.inner.read_into(blob_id, offset, buffer)

    def delete(self, blob_id: str) -> None:
        """The inner store's delete."""
        self.inner.delete(blob_id)

    def list_ids(self) -> Iterator[str]:
        """The inner store's ids."""
        return self.inner.list_ids()


def fail_staging_writes(monkeypatch: pytest.MonkeyPatch, error: OSError) -> list[tuple[Path, int, str]]:
    """Make the server's next staging file fail with ``error`` once half its bytes are written.

    The failure comes from the staging writer's own ``os.pwrite`` (direct or buffered), as a
    full disk would report it. Returns the list that records the file cut short (path, bytes
    on disk at the failure, the name of the thread whose write failed).
    """
    from ckptstore.service.intake import direct_file

    partial_files: list[tuple[Path, int, str]] = []
    fired = threading.Lock()  # shards and buffers are written at once: the fault fires for one write only

    def failing_pwrite(fd: int, data: Any, position: int) -> int:
        if partial_files or not fired.acquire(blocking=False):
            return os.pwrite(fd, data, position)
        view = memoryview(data).cast("B")
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        with open(path, "r+b") as handle:  # half the bytes land, whatever O_DIRECT would allow
            handle.seek(position)
            handle.write(view[: max(1, view.nbytes // 2)])
        partial_files.append((path, path.stat().st_size, threading.current_thread().name))
        raise error

    monkeypatch.setattr(direct_file, "os", _Overlay(os, pwrite=failing_pwrite))
    return partial_files


__all__ = ["POINTS", "FaultyBlobStore", "fail_staging_writes", "os_error"]
