"""Reading a large request body straight from its socket, off the event loop.

Through uvicorn, a body arrives as the parser's pieces (up to a few hundred KiB each), each a
new ``bytes`` object, a trip through the event loop and an ASGI ``receive``: on two cores,
taking 512 MiB that way cost 0.23 CPU-seconds, four times what ``recv_into`` costs. A route
that takes a body of known length can instead take the socket over once the headers are in
(:meth:`SocketBody.read`):

- the event loop stops reading the socket, and the pieces the parser already queued are handed
  on first, in order;
- a reading thread fills a few reused buffers with ``recv_into`` while the route's worker
  thread consumes the full ones (hashing and writing them), so receiving overlaps the work;
- the parser never sees the rest of the body, so the connection closes after the answer.

The read limits of :mod:`service.api.protocol` still hold: the body must bring ``min_body_rate``
bytes a second over every ``body_timeout`` window in which the server was reading it (time spent
waiting for the consumer to free a buffer does not count), else :class:`RequestTimeoutError`
(408). A client that hangs up mid-body gets :class:`InvalidInputError`. Bodies over TLS, of
unknown length (chunked) or small are not offered: they go through ``receive`` as before.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from service.direct_file import BUFFER_BYTES, give_back, take_buffer
from service.errors import InvalidInputError, RequestTimeoutError

#: The scope extension under which a request's :class:`SocketBody` is offered.
EXTENSION = "ckptstore.socket_body"
#: Bodies at least this long are offered (smaller ones gain little and would cost a reconnect).
MIN_BODY_BYTES = 8 << 20
#: Buffers per body: one being filled while the others are consumed.
BUFFERS = 3


Consume = Callable[[memoryview], object]


class Connection(Protocol):
    """What is used of :class:`service.api.protocol.PiecewiseBodyProtocol`."""

    transport: Any
    flow: Any
    body_timeout: float
    min_body_rate: int
    #: Body bytes of the current request the parser has handed on.
    body_seen: int


class Cycle(Protocol):
    """What is used of :class:`service.api.protocol.PiecewiseRequestCycle`."""

    scope: Any
    body: Any
    disconnected: bool
    response_complete: bool
    waiting_for_100_continue: bool
    more_body: bool
    keep_alive: bool
    socket_owned: bool


def offered(scope: MutableMapping[str, Any]) -> SocketBody | None:
    """The request's socket body, when the server offers it for this request."""
    extensions = scope.get("extensions") or {}
    body = extensions.get(EXTENSION)
    return body if isinstance(body, SocketBody) else None


def offer(protocol: Connection, cycle: Cycle) -> None:
    """Offer the body of the request whose headers just arrived, if it qualifies (see the module)."""
    if protocol.transport.get_extra_info("ssl_object") is not None:
        return
    sock = protocol.transport.get_extra_info("socket")
    if sock is None:
        return
    lengths = [value for name, value in cycle.scope["headers"] if name == b"content-length"]
    chunked = any(name == b"transfer-encoding" for name, _ in cycle.scope["headers"])
    if chunked or len(lengths) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
        return
    length = int(lengths[0])
    if length >= MIN_BODY_BYTES:
        extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
        extensions[EXTENSION] = SocketBody(protocol, cycle, sock.fileno(), length)


class SocketBody:
    """The body of one request, to be read from its socket once by :meth:`read`."""

    def __init__(self, protocol: Connection, cycle: Cycle, fd: int, length: int) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._fd = fd
        #: The body's length, from its Content-Length.
        self.length = length
        self._taken = False

    async def read(self, consume: Consume) -> int:
        """Hand every byte of the body, in order, to ``consume`` (called on a worker thread, with a
        view valid only during the call); returns the body's length.

        Raises:
            InvalidInputError: the client hung up before the whole body came.
            RequestTimeoutError: the body came too slowly.
            Whatever ``consume`` raises (the rest of the body is not read then).
        """
        if self._taken:
            raise RuntimeError("a request body is read once")
        self._taken = True
        protocol, cycle = self._protocol, self._cycle
        if cycle.disconnected or cycle.response_complete:
            raise InvalidInputError("the client hung up before its request body came")
        if cycle.waiting_for_100_continue and not protocol.transport.is_closing():
            protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        cycle.socket_owned = True
        protocol.flow.pause_reading()
        queued = []
        while piece := cycle.body.take():
            queued.append(piece)
        left = self.length - protocol.body_seen if cycle.more_body else 0
        if left:
            cycle.keep_alive = False  # the parser misses the rest: this connection ends with the answer
        await run_in_threadpool(self._pump, queued, left, consume)
        cycle.more_body = False
        return self.length

    def _pump(self, queued: list[bytes], left: int, consume: Consume) -> None:
        """Consume the queued pieces, then the rest of the body as a reading thread fills buffers."""
        for piece in queued:
            consume(memoryview(piece))
        if not left:
            return
        free: queue.SimpleQueue[mmap.mmap | None] = queue.SimpleQueue()
        full: queue.SimpleQueue[tuple[mmap.mmap, int] | BaseException | None] = queue.SimpleQueue()
        buffers = [take_buffer() for _ in range(min(BUFFERS, -(-left // BUFFER_BYTES)))]
        for buffer in buffers:
            free.put(buffer)
        done = self.length - left
        sock = socket.socket(fileno=os.dup(self._fd))  # closing it leaves the connection open
        reader = threading.Thread(
            target=self._receive, args=(sock, left, done, free, full), name="ckptstore-body", daemon=True
        )
        reader.start()
        try:
            while (item := full.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                buffer, filled = item
                consume(memoryview(buffer)[:filled])
                free.put(buffer)
        except BaseException:
            _stop_reading(sock)  # a reader waiting for bytes that will never be wanted returns now
            raise
        finally:
            free.put(None)  # a reader waiting for a buffer stops
            reader.join()
            sock.close()
            for buffer in buffers:
                give_back(buffer)

    def _receive(
        self,
        sock: socket.socket,
        left: int,
        done: int,
        free: queue.SimpleQueue[mmap.mmap | None],
        full: queue.SimpleQueue[tuple[mmap.mmap, int] | BaseException | None],
    ) -> None:
        """The reading thread: fill free buffers from ``sock`` until ``left`` bytes are read."""
        window = RateWindow(self._protocol.body_timeout, self._protocol.min_body_rate)
        try:
            while left:
                window.pause()
                buffer = free.get()
                window.resume()
                if buffer is None:
                    return  # the consumer stopped
                view, filled = memoryview(buffer)[: min(len(buffer), left)], 0
                while filled < view.nbytes:
                    sock.settimeout(window.left())
                    try:
                        got = sock.recv_into(view[filled:])
                    except TimeoutError:
                        window.check(done + filled)
                        continue
                    if not got:
                        raise InvalidInputError(f"the upload was cut off after {done + filled} bytes; retry it")
                    filled += got
                    window.add(got)
                    window.check(done + filled)
                left -= filled
                done += filled
                full.put((buffer, filled))
            full.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            full.put(exc)


def _stop_reading(sock: socket.socket) -> None:
    """Make a ``recv`` waiting on ``sock`` return at once (the connection ends with the answer anyway)."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass  # already gone


class RateWindow:
    """The least-rate rule of a body read: ``rate`` bytes a second over every window of ``seconds``
    in which the server was reading (paused time does not count)."""

    def __init__(self, seconds: float, rate: int) -> None:
        self.seconds = seconds
        self.rate = rate
        self._end = time.monotonic() + seconds
        self._bytes = 0
        self._paused_at: float | None = None

    def pause(self) -> None:
        """The reader waits for a buffer: the window's clock stops."""
        self._paused_at = time.monotonic()

    def resume(self) -> None:
        """The reader reads again: the window ends later by the time it waited."""
        if self._paused_at is not None:
            self._end += time.monotonic() - self._paused_at
            self._paused_at = None

    def add(self, nbytes: int) -> None:
        """Count bytes received in this window."""
        self._bytes += nbytes

    def left(self) -> float:
        """Seconds left in this window (at least a millisecond)."""
        return max(self._end - time.monotonic(), 0.001)

    def check(self, received: int) -> None:
        """At a window's end: start the next one, or raise if too few bytes came in this one."""
        if time.monotonic() < self._end:
            return
        if self._bytes < self.rate * self.seconds:
            raise RequestTimeoutError(
                f"the request body brought {self._bytes} bytes in {self.seconds:g} seconds (after {received} "
                f"bytes); the server needs at least {self.rate} bytes a second"
            )
        self._end, self._bytes = time.monotonic() + self.seconds, 0
