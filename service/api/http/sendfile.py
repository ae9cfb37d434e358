"""Blob bytes sent from their files into a connection's socket by the kernel (``sendfile``).

A streamed answer (:mod:`service.api.http.streaming`) reads each 1 MiB piece into a new buffer on a
worker thread, hands it to the event loop, and the loop copies it into the socket: every byte
of a download is copied twice in the server and costs a thread hop per piece. Where blobs are
local files and the connection is plain TCP, the server offers the app the
``ckptstore.sendfile`` extension instead. After its status line the app sends one message,
``{"type": "ckptstore.sendfile", "segments": ..., "more_body": bool}``, whose segments are
``(file descriptor, offset, count)`` triples; the kernel moves them from the page cache to the
socket with ``sendfile``, no byte passing through Python. On a 2-core VM a 512 MiB load took
0.18 CPU-seconds of the server against 1.08 streamed, and eight readers of 512 MiB each 0.88
against 2.95 (``bench/http_vs_embedded.py``).

- The sends run on a worker thread (a cold file blocks there, never on the event loop), on a
  duplicate of the socket's descriptor. When the socket has no room for
  :data:`THREAD_WAIT_SECONDS`, the thread is given back and the event loop waits for room, so
  a client that stops reading holds no thread, as with streamed answers.
- The write deadline holds as it does for streamed answers: a client that takes nothing for
  ``write_timeout`` seconds is reset.
- Segments are consumed on the sending thread, in order; an iterator that opens files as it
  goes closes them itself (it is closed when the answer ends, whatever ends it).
- A file that ends early, cannot be read or is gone after the status line went out ends the
  connection with a reset, logged: the client sees a body cut short, never wrong bytes.

TLS connections, systems without ``sendfile`` or ``poll``, and servers other than ``ckptstore
serve`` do not offer the extension: the routes fall back to streamed answers there.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import select
import struct
import termios
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ckptstore.service.errors import CheckpointError, StorageError

log = logging.getLogger("ckptstore.server")

#: The scope extension (and the ASGI message type) under which the server takes file segments.
EXTENSION = "ckptstore.sendfile"
#: How long a sending thread waits for room in the socket before the event loop takes the wait over.
THREAD_WAIT_SECONDS = 0.05
#: The most bytes one ``sendfile`` call is asked to move.
CALL_BYTES = 64 << 20
#: ``sendfile`` errors that mean the client is gone (any other is the file's).
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN, errno.ECONNABORTED, errno.ETIMEDOUT}

#: A segment: ``count`` bytes of the open file ``fd`` from ``offset``.
Segment = tuple[int, int, int]


class Cycle(Protocol):
    """What is used of :class:`service.api.http.protocol.PiecewiseRequestCycle`."""

    scope: Any
    transport: Any
    flow: Any
    disconnected: bool
    response_started: bool
    response_complete: bool
    chunked_encoding: bool | None
    expected_content_length: int
    message_event: asyncio.Event
    write_deadline: Any


#: Whether this system has what the sender uses (Linux has; macOS lacks ``poll``).
SUPPORTED = hasattr(os, "sendfile") and hasattr(select, "poll")


def offer(transport: Any, scope: Any) -> None:
    """Offer the extension to a request on ``transport`` when it is plain TCP with a socket, on a
    system that has ``sendfile`` and ``poll``."""
    if not SUPPORTED or transport.get_extra_info("ssl_object") is not None:
        return
    if transport.get_extra_info("socket") is None:
        return
    scope.setdefault("extensions", {})[EXTENSION] = {}


def offered(scope: MutableMapping[str, Any]) -> bool:
    """Whether the server takes file segments for this request's answer."""
    return EXTENSION in (scope.get("extensions") or {})


class WriteTimedOut(Exception):
    """The client took nothing for the whole write timeout."""


class SegmentSender:
    """Sends segments down one socket descriptor, in order, from a worker thread at a time."""

    def __init__(self, out_fd: int, segments: Iterable[Segment], stopped: Callable[[], bool]) -> None:
        self.out_fd = out_fd
        self.sent = 0
        self._segments = iter(segments)
        self._current: Segment | None = None
        self._stopped = stopped
        self._poll = select.poll()
        self._poll.register(out_fd, select.POLLOUT)

    def run(self, wait: float) -> bool:
        """Send until every segment is out (True), or until the socket had no room for ``wait``
        seconds (False: call again once it has).

        Raises:
            ConnectionResetError: the client is gone.
            StorageError: a file ended early or could not be read.
        """
        while True:
            if self._current is None or not self._current[2]:
                self._current = next(self._segments, None)
                if self._current is None:
                    return True
                continue
            if self._stopped():
                raise ConnectionResetError("the client is gone")
            fd, offset, left = self._current
            try:
                moved = os.sendfile(self.out_fd, fd, offset, min(left, CALL_BYTES))
            except BlockingIOError:
                if not self._poll.poll(wait * 1000):
                    return False
                continue
            except OSError as exc:
                if exc.errno in _PEER_GONE:
                    raise ConnectionResetError(f"the client is gone ({exc.strerror})") from exc
                raise StorageError(f"reading a blob file to send failed: {exc.strerror or exc}") from exc
            if moved == 0:
                raise StorageError(f"a blob file ends {left} bytes before its recorded size")
            self.sent += moved
            self._current = (fd, offset + moved, left - moved)


async def send_segments(
    cycle: Cycle, segments: Iterable[Segment], write_timeout: float, reset: Callable[[Any], None]
) -> None:
    """Send ``segments`` as (part of) the body of the answer under way on ``cycle``.

    Returns once they are all in the socket, or at once if the client is gone; a client that
    takes nothing for ``write_timeout`` seconds, or a file that cannot be sent whole, ends the
    connection with ``reset(transport)`` (the cycle then counts as disconnected).
    """
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()  # the status line and anything before it are out
    if cycle.disconnected:
        return
    if not cycle.response_started or cycle.response_complete or cycle.chunked_encoding is not False:
        raise RuntimeError("file segments go after the status line of an answer with a Content-Length")
    if cycle.scope["method"] == "HEAD":
        return
    deadline = cycle.write_deadline
    if deadline is not None:
        deadline.stop()  # the sending loop below keeps the write timeout itself
    out_fd = os.dup(cycle.transport.get_extra_info("socket").fileno())
    sender = SegmentSender(out_fd, segments, lambda: cycle.disconnected)
    try:
        await _pump(sender, out_fd, write_timeout)
    except ConnectionResetError:
        _end(cycle, None, reset)
        return
    except WriteTimedOut:
        unsent = _unsent(out_fd)
        _end(cycle, f"it did not take the {unsent} bytes it was sent within {write_timeout:g} s", reset)
        return
    except CheckpointError as exc:  # a file that ended early, could not be read, or went away
        _end(cycle, f"its answer could not be read whole: {exc}", reset)
        return
    finally:
        os.close(out_fd)
    if sender.sent > cycle.expected_content_length:
        _end(cycle, "its answer ran past its Content-Length", reset)
        return
    cycle.expected_content_length -= sender.sent
    if deadline is not None:
        deadline.taken()


async def _pump(sender: SegmentSender, out_fd: int, write_timeout: float) -> None:
    """Run ``sender`` on worker threads, waiting on the event loop while the socket has no room."""
    loop = asyncio.get_running_loop()
    last_progress = loop.time()
    while True:
        before = sender.sent
        if await run_in_threadpool(sender.run, THREAD_WAIT_SECONDS):
            return
        now = loop.time()
        if sender.sent > before:
            last_progress = now
        left = write_timeout - (now - last_progress)
        if left <= 0 or not await _writable(loop, out_fd, left):
            raise WriteTimedOut


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, seconds: float) -> bool:
    """Whether ``fd`` has room to write within ``seconds``, waited for on the event loop."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        async with asyncio.timeout(seconds):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(fd)


def _unsent(fd: int) -> int:
    """Bytes the kernel holds for the socket ``fd`` that the peer has not taken (0 where unknown)."""
    try:
        count = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4)
    except (OSError, AttributeError):
        return 0
    return int(struct.unpack("i", count)[0])


def _end(cycle: Cycle, reason: str | None, reset: Callable[[Any], None]) -> None:
    """Reset the connection of an answer that cannot go on, and log why (unless the client left)."""
    if reason is not None:
        client = cycle.scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "a client"
        log.warning("closed a connection from %s: %s", peer, reason)
    cycle.disconnected = True
    cycle.message_event.set()
    if not cycle.transport.is_closing():
        reset(cycle.transport)


class FileSpans:
    """The segments of ``(blob id, offset, length)`` spans, each blob's file opened with ``opener``
    when first needed and kept open while consecutive spans read it.

    ``opened`` is a ``(blob id, descriptor)`` opened already (by the route, before its status
    line, so that a missing blob is a 404); it is closed with the rest. :meth:`close` closes
    every file still open, whether or not iteration started or finished.
    """

    def __init__(
        self,
        opener: Callable[[str], int | None],
        spans: Iterable[tuple[str, int, int]],
        opened: tuple[str, int] | None = None,
    ) -> None:
        self._opener = opener
        self._spans = spans
        self._blob_id: str | None = None
        self._fd = -1
        if opened is not None:
            self._blob_id, self._fd = opened

    def __iter__(self) -> Iterator[Segment]:
        for blob_id, offset, length in self._spans:
            if blob_id != self._blob_id:
                self.close()
                fd = self._opener(blob_id)
                if fd is None:
                    raise StorageError(f"blob {blob_id} is not a local file")
                self._blob_id, self._fd = blob_id, fd
            yield self._fd, offset, length

    def close(self) -> None:
        """Close the file open now, if any."""
        fd, self._blob_id, self._fd = self._fd, None, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        # An answer built but never sent (the request ended first) still gives its file back.
        self.close()


class FileAnswer(Response):
    """An ``application/octet-stream`` answer whose body is :class:`FileSpans`, sent by the kernel.

    Only for a request that :func:`offered` the extension; ``headers`` must carry the body's
    Content-Length. The files are closed when the answer ends, whatever ends it.
    """

    def __init__(self, spans: FileSpans, status_code: int, headers: Mapping[str, str]) -> None:
        super().__init__(None, status_code, headers, media_type="application/octet-stream")
        self._spans = spans

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The status line, then the spans' bytes."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": EXTENSION, "segments": self._spans, "more_body": False})
        finally:
            self._spans.close()
