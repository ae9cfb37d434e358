"""Reading a large request body straight from its socket, off the event loop, into where it goes.

Through uvicorn, a body arrives as the parser's pieces (up to a few hundred KiB each), each a
new ``bytes`` object, a trip through the event loop and an ASGI ``receive``: on two cores,
taking 512 MiB that way cost 0.23 CPU-seconds, four times what ``recv_into`` costs. A route
that takes a body of known length can instead take the socket over once the headers are in
(:meth:`SocketBody.read_into`):

- the event loop stops reading the socket, and the pieces the parser already queued are handed
  on first, in order;
- a worker thread then receives the rest with ``recv_into`` straight into the memory the
  consumer names (:class:`Landing`): a shard upload's bytes land in the staging file's aligned
  write buffer, are hashed there and written from there, never copied in user space. One
  ``recv`` with ``MSG_WAITALL`` fills up to a whole buffer; meanwhile the client keeps sending
  into the socket's buffer, so its sending overlaps the server's hashing. The socket's receive
  low-water mark (:mod:`service.receive_mark`) has the kernel wake that thread once a megabyte
  waits rather than at each segment.
- the parser never sees the rest of the body, so the connection closes after the answer; when
  the consumer refuses the body midway (a tensor that does not match its digest), up to 16 MiB
  of what the client sent already is read and dropped first, so that closing with bytes unread
  does not reset the connection before the client reads why.

Measured on a 2-core VM saving 512 MiB over HTTP (medians of 9): a reading thread filling
buffers of its own, which the route's thread then hashed and copied into the staging file's
buffers, cost the server 0.59 CPU-seconds, 13% of its samples in that copy; received in place,
0.50.

The read limits of :mod:`service.api.http.protocol` still hold: the body must bring ``min_body_rate``
bytes a second over every ``body_timeout`` window in which the server was reading it (time the
consumer spends on what landed does not count), else :class:`RequestTimeoutError` (408). A
client that hangs up mid-body gets :class:`InvalidInputError`. Bodies over TLS, of unknown
length (chunked) or small are not offered: they go through ``receive`` as before.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import MutableMapping
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from ckptstore.service.errors import InvalidInputError, RequestTimeoutError
from ckptstore.service.receive_mark import ReceiveMark

#: The scope extension under which a request's :class:`SocketBody` is offered.
EXTENSION = "ckptstore.socket_body"
#: Bodies at least this long are offered (smaller ones gain little and would cost a reconnect).
MIN_BODY_BYTES = 8 << 20
#: Of a body the app refuses midway, at most this much that the client sent already is read and
#: dropped before the answer, waiting at most DISCARD_WAIT seconds for each piece and
#: DISCARD_SECONDS in all (see :func:`_discard_sent`).
DISCARD_BYTES = 16 << 20
DISCARD_WAIT = 0.1
DISCARD_SECONDS = 1.0


class Landing(Protocol):
    """Where a body read by :meth:`SocketBody.read_into` goes, given in order."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Take the body's first bytes, which came with the headers (a copy is made if kept)."""

    def space(self) -> memoryview:
        """Writable memory, at least one byte, for the body's next bytes."""

    def landed(self, nbytes: int) -> None:
        """The first ``nbytes`` of the memory :meth:`space` last gave hold the body's next bytes."""


class Connection(Protocol):
    """What is used of :class:`service.api.http.protocol.PiecewiseBodyProtocol`."""

    transport: Any
    flow: Any
    body_timeout: float
    min_body_rate: int
    #: Body bytes of the current request the parser has handed on.
    body_seen: int


class Cycle(Protocol):
    """What is used of :class:`service.api.http.protocol.PiecewiseRequestCycle`."""

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
    """The body of one request, to be read from its socket once by :meth:`read_into`."""

    def __init__(self, protocol: Connection, cycle: Cycle, fd: int, length: int) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._fd = fd
        #: The body's length, from its Content-Length.
        self.length = length
        self._taken = False

    async def read_into(self, landing: Landing) -> int:
        """Receive every byte of the body, in order, into ``landing`` (on a worker thread); returns
        the body's length.

        Raises:
            InvalidInputError: the client hung up before the whole body came.
            RequestTimeoutError: the body came too slowly.
            Whatever ``landing`` raises (the rest of the body is not read then).
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
        await run_in_threadpool(self._pump, queued, left, landing)
        cycle.more_body = False
        return self.length

    def _pump(self, queued: list[bytes], left: int, landing: Landing) -> None:
        """Hand on the queued pieces, then receive the rest of the body into ``landing``."""
        for piece in queued:
            landing.write(piece)
        if not left:
            return
        sock = socket.socket(fileno=os.dup(self._fd))  # closing it leaves the connection open
        mark = ReceiveMark(sock)  # the socket's, not the duplicate's: reset below
        try:
            sock.setblocking(True)  # shared with the event loop's descriptor: made non-blocking again below
            self._receive(sock, left, landing, mark)
        finally:
            mark.reset()
            _set_receive_timeout(sock, 0.0)
            sock.setblocking(False)
            sock.close()

    def _receive(self, sock: socket.socket, left: int, landing: Landing, mark: ReceiveMark) -> None:
        """Fill ``landing``'s space from ``sock`` until ``left`` bytes are read, keeping the rate
        rule, with the socket's receive low-water mark (``mark``) set for each receive."""
        window = RateWindow(self._protocol.body_timeout, self._protocol.min_body_rate)
        done = self.length - left
        while left:
            space = landing.space()
            want = min(space.nbytes, left)
            _set_receive_timeout(sock, window.left())
            mark.before(left, want)
            try:
                got = sock.recv_into(space, want, socket.MSG_WAITALL)
            except BlockingIOError:  # the receive timeout ran out with nothing received
                got = -1
            except ConnectionError as exc:  # reset by the client
                raise InvalidInputError(f"the upload was cut off after {done} bytes; retry it") from exc
            finally:
                del space  # landing may hand its memory on once told
            if got == 0:
                raise InvalidInputError(f"the upload was cut off after {done} bytes; retry it")
            if got > 0:
                window.add(got)
                done, left = done + got, left - got
                window.pause()
                try:
                    landing.landed(got)
                except BaseException:
                    mark.reset()  # the discard takes what comes, however little
                    _discard_sent(sock, left)
                    raise
                window.resume()
            window.check(done)


def _discard_sent(sock: socket.socket, left: int) -> None:
    """Read and drop what the client has sent of the rest of a body that is refused, up to
    :data:`DISCARD_BYTES` and for at most :data:`DISCARD_SECONDS`, until none comes for
    :data:`DISCARD_WAIT` seconds: a connection closed with bytes unread is reset, and the client
    might lose the answer that says why."""
    scratch = bytearray(256 << 10)
    deadline = time.monotonic() + DISCARD_SECONDS
    dropped = 0
    while dropped < min(left, DISCARD_BYTES) and (wait := min(DISCARD_WAIT, deadline - time.monotonic())) > 0:
        _set_receive_timeout(sock, wait)
        try:
            got = sock.recv_into(scratch, min(len(scratch), left - dropped))
        except OSError:  # nothing more came in time, or the client is gone
            return
        if not got:
            return
        dropped += got


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """The kernel's receive timeout for ``sock`` (0: none): a ``MSG_WAITALL`` receive returns what
    came by then."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


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
