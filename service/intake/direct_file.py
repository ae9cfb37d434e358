"""Writing a new file at the device's speed: around the page cache (``O_DIRECT``) where the file
system allows it, else buffered with its write-back started as the bytes arrive.

A buffered write copies every byte into page-cache pages the kernel must first allocate and
map, and then writes them back to the device on ``fsync``. For a store that writes each shard
once and does not read it back soon, that copy is most of the cost of a durable save: on a
VM whose fresh memory is slow to touch, buffered write + fsync of 1 GiB took 2.6-3.2 s where
the same bytes went to the device in 0.44-0.64 s with ``O_DIRECT``.

Bytes are gathered in page-aligned buffers (reused across files, so their memory stays
resident) and written a whole buffer at a time, each at its own file position, so with
``in_flight`` several buffers are on their way to the device while the next is filled: one
file keeps the device's queue busy, and the caller's own work (hashing) overlaps it. The last
block of a direct file is padded and the file then cut to its true length.

File systems without ``O_DIRECT`` (tmpfs before Linux 6.6, some network and FUSE mounts) get
buffered writes through the same interface, as does every file when direct writes are turned
off (``CKPTSTORE_DIRECT_WRITES=0``). A buffered file starts the write-back of each
:data:`WRITEBACK_BYTES` as soon as they are written (``sync_file_range``), and drops the pages
of the stretch before from the page cache once they are on the device, so the final ``fsync``
finds almost nothing left to write and a large save does not fill memory with dirty pages.
Either way the caller still fsyncs the file.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

#: Alignment of O_DIRECT writes: a multiple of every common logical block size (512, 4096).
ALIGNMENT = 4096
#: Bytes gathered before each write.
BUFFER_BYTES = 4 << 20
#: Idle buffers kept for the next files (each BUFFER_BYTES of resident memory): the sixteen a
#: process writing shards kept; a server's uploads receive their bodies into their staging
#: files' buffers (:mod:`service.api.http.socket_body`), three for each.
MAX_IDLE_BUFFERS = 16
#: Threads writing full buffers, shared by every file being written in the process (started as needed).
WRITER_THREADS = 16
#: Buffers a shard file keeps on their way to the device (``in_flight``). Measured on a 2-core VM
#: writing 750 MiB as three shards, two at a time, direct: 0 in flight 0.45-0.84 s, 3 in flight
#: 0.34-0.45 s, 6 in flight 0.31-0.39 s (``bench/full_save.py``): one 4 MiB write at a time
#: leaves the device idle while the next buffer is copied and hashed.
DEFAULT_IN_FLIGHT = 6
#: Buffered files: write-back is started for every stretch of this many bytes.
WRITEBACK_BYTES = 8 << 20

_idle_buffers: list[mmap.mmap] = []
_idle_lock = threading.Lock()
_writers: ThreadPoolExecutor | None = None

#: Bytes of a piece, as a file's :meth:`DirectFileWriter.write` sees them land in its buffer.
Observer = Callable[[memoryview], object]


def take_buffer() -> mmap.mmap:
    """A page-aligned buffer of BUFFER_BYTES from the idle pool, or a new one; :func:`give_back` it."""
    with _idle_lock:
        if _idle_buffers:
            return _idle_buffers.pop()
    return mmap.mmap(-1, BUFFER_BYTES)  # anonymous mappings are page-aligned


def give_back(buffer: mmap.mmap) -> None:
    """Return a buffer to the idle pool (closed instead when the pool is full)."""
    with _idle_lock:
        if len(_idle_buffers) < MAX_IDLE_BUFFERS:
            _idle_buffers.append(buffer)
            return
    try:
        buffer.close()
    except BufferError:
        pass  # a view of it is still alive somewhere: the mapping goes when that view does


def warm_buffers(count: int) -> None:
    """Fill the idle pool with up to ``count`` buffers whose pages are already in memory.

    A server calls this on starting: on a VM where first touching memory is slow, the first
    large upload otherwise paid for faulting in its buffers (they stay pooled after it anyway).
    """
    with _idle_lock:
        wanted = min(count, MAX_IDLE_BUFFERS) - len(_idle_buffers)
    for _ in range(max(wanted, 0)):
        buffer = mmap.mmap(-1, BUFFER_BYTES)
        buffer.write(bytes(BUFFER_BYTES))  # every page touched once
        buffer.seek(0)
        give_back(buffer)


def _writer_pool() -> ThreadPoolExecutor:
    """The threads that write full buffers while their files' next bytes are gathered."""
    global _writers
    with _idle_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="ckptstore-write")
        return _writers


class DirectFileWriter:
    """A new file at ``path`` written front to back with :meth:`write`, then :meth:`close`.

    Every byte is copied into one of the file's page-aligned buffers; a full buffer is written
    at its position in the file, on a background thread when ``in_flight`` allows, so the
    caller gathers the next bytes meanwhile. :meth:`write`'s ``observe`` sees each piece in the
    buffer it was copied to, before that buffer is written: a digest taken there is of the
    bytes written, whatever happens to the caller's memory afterwards.

    Args:
        path: the file to create; it must not exist.
        direct: bypass the page cache if the file system supports it.
        in_flight: full buffers written in the background while the next is filled (0: each
            is written before :meth:`write` returns).
        start: leave this many bytes (a multiple of :data:`ALIGNMENT`) free at the start of
            the file for :meth:`write_head`, and append from there.
        exists: the file was made empty beforehand and is held by the caller (a staging file,
            :func:`service.blobs.held_file.hold_new`): open it rather than create it.

    Raises OSError from the file system (ENOSPC, EIO, EEXIST) unchanged; an error of a
    background write is raised by the next :meth:`write` that needs its buffer, or by
    :meth:`close`, and no write is started after it.
    """

    def __init__(
        self, path: Path | str, *, direct: bool = True, in_flight: int = 0, start: int = 0, exists: bool = False
    ) -> None:
        if start < 0 or start % ALIGNMENT:
            raise ValueError(f"start must be a non-negative multiple of {ALIGNMENT}, not {start}")
        if in_flight < 0:
            raise ValueError(f"in_flight must not be negative, not {in_flight}")
        self.path = Path(path)
        self.in_flight = in_flight
        self.start = start
        self.size = start
        flags = os.O_WRONLY | os.O_CLOEXEC | (0 if exists else os.O_CREAT | os.O_EXCL)
        self.direct = direct and hasattr(os, "O_DIRECT")
        fd = -1
        if self.direct:
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # tmpfs and others refuse the flag at open
        self._fd = fd if fd >= 0 else os.open(self.path, flags, 0o666)
        self._buffers: list[mmap.mmap] = [take_buffer() for _ in range(in_flight + 1)]
        self._views = [memoryview(buffer) for buffer in self._buffers]
        self._writing: list[Future[None] | None] = [None] * len(self._buffers)
        self._current = 0
        self._view = self._views[0]
        self._filled = 0
        self._position = start  # where the current buffer's bytes go in the file
        self._end = start  # the end of the furthest write started (a padded block included)
        self._writeback = _Writeback(self._fd) if not self.direct else None
        self._failed: BaseException | None = None
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview, observe: Observer | None = None) -> None:
        """Append ``data`` to the file; ``observe`` is called with each piece as copied, in order."""
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        end = self._filled + view.nbytes
        if end < BUFFER_BYTES:  # the common case for small tensors: it fits, one copy, no loop
            self._view[self._filled : end] = view
            if observe is not None:
                observe(self._view[self._filled : end])
            self._filled = end
            return
        while view.nbytes:
            take = min(view.nbytes, BUFFER_BYTES - self._filled)
            self._view[self._filled : self._filled + take] = view[:take]
            if observe is not None:
                observe(self._view[self._filled : self._filled + take])
            self._filled += take
            view = view[take:]
            if self._filled == BUFFER_BYTES:
                self._write_full_buffer()

    def space(self) -> memoryview:
        """The free rest of the buffer being filled: bytes put there are appended by :meth:`advance`.

        For bytes that can be made in place, such as a socket's (``recv_into``), which then
        need no copy into the buffer. The view is valid until the next call of any other method.
        """
        return self._view[self._filled :]

    def advance(self, nbytes: int) -> None:
        """Append the first ``nbytes`` of the memory :meth:`space` gave, put there since."""
        if not 0 < nbytes <= BUFFER_BYTES - self._filled:
            raise ValueError(f"{nbytes} bytes do not fit the {BUFFER_BYTES - self._filled} bytes of space")
        self.size += nbytes
        self._filled += nbytes
        if self._filled == BUFFER_BYTES:
            self._write_full_buffer()

    def write_head(self, data: bytes) -> None:
        """Write ``data``, exactly ``start`` bytes long, into the space left free at the start."""
        if len(data) != self.start:
            raise ValueError(f"the head is {self.start} bytes, not {len(data)}")
        if not self.direct:
            self._write_at(memoryview(data), 0)
            return
        aligned = mmap.mmap(-1, len(data))  # direct writes need page-aligned memory
        try:
            aligned.write(data)
            self._write_at(memoryview(aligned), 0)
        finally:
            try:
                aligned.close()
            except BufferError:
                pass  # an error's traceback still holds a view of it: the mapping goes with that

    def close(self) -> None:
        """Write what is buffered and close the file (its length is exactly the bytes written)."""
        if self._closed:
            return
        try:
            self._wait_all()
            if self._filled:
                self._write_tail()
            if self._end > self.size:
                os.ftruncate(self._fd, self.size)  # a padded last block: cut the file back
        finally:
            self._release()

    def abort(self) -> None:
        """Close without writing what is buffered (the caller removes the file)."""
        if self._closed:
            return
        try:
            self._wait_all()
        except OSError:
            pass  # the file is being given up anyway
        finally:
            self._release()

    def _write_full_buffer(self) -> None:
        """Start writing the full buffer (or write it, without ``in_flight``); gather into the next."""
        position, view = self._position, self._view
        self._position += BUFFER_BYTES
        self._end = max(self._end, self._position)
        if self.in_flight:
            self._writing[self._current] = _writer_pool().submit(self._write_in_background, view, position)
            self._current = (self._current + 1) % len(self._buffers)
            self._view = self._views[self._current]
            self._wait(self._current)  # the buffer about to be filled must be written first
        else:
            self._write_at(view, position)
        self._filled = 0

    def _write_tail(self) -> None:
        """Write the partly filled buffer; a direct write pads it to a block (cut back by close)."""
        length = self._filled
        if self.direct:
            length = -(-length // ALIGNMENT) * ALIGNMENT
            self._view[self._filled : length] = bytes(length - self._filled)
        self._write_at(self._view[:length], self._position)
        self._end = max(self._end, self._position + length)

    def _write_in_background(self, view: memoryview, position: int) -> None:
        if self._failed is not None:
            return  # a write before this one failed: write nothing more, the caller gets that error
        try:
            self._write_at(view, position)
        except BaseException as exc:
            self._failed = exc
            raise

    def _wait(self, index: int) -> None:
        """Wait for buffer ``index``'s background write (raising its error, or an earlier one's)."""
        writing, self._writing[index] = self._writing[index], None
        if writing is not None:
            writing.result()
        if self._failed is not None:
            raise self._failed

    def _wait_all(self) -> None:
        """Wait for every background write (none runs on past the close); raise the first error."""
        first: BaseException | None = None
        for index in range(len(self._writing)):
            try:
                self._wait(index)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _release(self) -> None:
        self._closed = True
        for view in self._views:
            view.release()
        try:
            os.close(self._fd)
        finally:
            for buffer in self._buffers:
                give_back(buffer)

    def _write_at(self, view: memoryview, position: int) -> None:
        """Write all of ``view`` at ``position`` in the file."""
        start, length = position, view.nbytes
        while view.nbytes:
            try:
                written = os.pwrite(self._fd, view, position)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._stop_direct()  # the file system took the flag at open but refuses the writes
                continue
            view = view[written:]
            position += written
        if self._writeback is not None:
            self._writeback.written(start, length)

    def _stop_direct(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False
        self._writeback = _Writeback(self._fd)


class _Writeback:
    """Streaming write-back of a buffered file: each :data:`WRITEBACK_BYTES` stretch is handed to
    the device as soon as it is written, and the one before it, by then on the device, leaves
    the page cache. Where the system lacks ``sync_file_range`` this does nothing (the final
    fsync writes everything, as a plain buffered write would)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.started = 0  # write-back started for [0, started)
        self.lock = threading.Lock()

    def written(self, start: int, length: int) -> None:
        """Note that ``[start, start + length)`` was written; start write-back of full stretches."""
        if _sync_file_range is None:
            return
        with self.lock:
            end = start + length
            if end - self.started < WRITEBACK_BYTES:
                return  # not yet a full stretch (or a write that finished after a later one)
            # Pages of the stretch still being written by another thread are not dirty yet:
            # they miss this start, and the final fsync writes them.
            begin, self.started = self.started, end - end % ALIGNMENT
        _start_writeback(self.fd, begin, self.started - begin)
        if begin >= WRITEBACK_BYTES:
            _drop_written(self.fd, begin - WRITEBACK_BYTES, WRITEBACK_BYTES)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` to the device, without waiting."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _WRITE)  # advisory: a failure shows up in the fsync


def _drop_written(fd: int, offset: int, length: int) -> None:
    """Wait for the range's write-back, then drop its pages: the store does not read a shard back soon."""
    if _sync_file_range is not None and _sync_file_range(fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER) == 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
