"""uvicorn's httptools protocol, handing request bodies to the app without copying them.

Stock uvicorn appends every piece of a request body that the parser produces to one growing
``bytearray`` and, when the app asks for the body, copies that buffer again with ``bytes()``:
two copies of every uploaded byte on the event loop, plus the buffer's reallocations, before
the app sees any of it. Here the parser's pieces are queued as they are, and each ``receive``
hands the app the oldest one. The bytes are never copied in Python; a shard upload batches
the pieces itself before it hashes and writes them.

Everything else (flow control, ``Expect: 100-continue``, disconnects, pipelining, keep-alive)
is uvicorn's own: only the request cycle's body buffer and ``receive`` are replaced, on the
cycle object uvicorn has just built for each request.

A large body of known length may also be read from the socket by the app itself, off the event
loop (:mod:`service.api.http.socket_body`).

An answer made of local files may be sent by the kernel (:mod:`service.api.http.sendfile`).

Four more things uvicorn lacks are added per connection (:class:`PiecewiseBodyProtocol`):

- **read timeouts.** A request's line and headers must arrive within ``header_timeout``
  seconds (counted from the connection's start, or from a request's first byte on a kept-alive
  connection), else the connection is closed, with a 408 if part of a request came. A body must
  bring ``min_body_rate`` bytes a second over every ``body_timeout`` window in which the server
  was reading it (a window in which the server paused reading, being busy with what it had, does
  not count), else the connection is closed. A client trickling a byte a second is dropped at
  the end of its first window; other connections never wait on it.
- **a write timeout.** From a response's status line until its last byte is taken, the client
  must take everything the server has written within ``write_timeout`` seconds of last having
  taken all (:class:`WriteDeadline`; the time the app spends reading its next piece, or waiting
  for memory to read it into, counts too). Past it the connection is reset: the bytes the
  transport and the kernel still hold for it are dropped, and the app sees a disconnect. uvicorn
  has no such limit: a client that stopped reading kept its connection, and the answer's
  unsent bytes, for good (a plain close waits for them to be sent). The transport pauses at its
  first unsent byte (high-water mark 0), so ``send`` returns once everything sent before has
  been taken: an app holds what it is sending and at most one piece before it.
- **a connection cap** (uvicorn's ``limit_concurrency``): past ``max_connections`` open
  connections a request is answered 503, in JSON.
- **JSON errors.** uvicorn answers a request it cannot parse with a plain-text 400; here the
  body is ``{"code": "invalid_input", "message": ...}`` like every other error of the service.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from uvicorn._types import ASGIReceiveEvent, ASGISendEvent
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from ckptstore.service.api.http import sendfile
from ckptstore.service.api.http.socket_body import offer

#: Defaults of the read timeouts, for a uvicorn Config that does not carry them
#: (see :class:`service.api.server.ServerConfig`, which takes them from the settings).
HEADER_TIMEOUT = 20.0
BODY_TIMEOUT = 20.0
MIN_BODY_RATE = 1024
WRITE_TIMEOUT = 30.0


class BodyPieces:
    """Request body received but not yet handed to the app, piece by piece.

    uvicorn's protocol adds to it with ``+=`` and pauses the socket once ``len()`` passes its
    high-water mark, exactly as it does with its own buffer.
    """

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._size = 0

    def __iadd__(self, piece: bytes) -> BodyPieces:
        self._pieces.append(piece)
        self._size += len(piece)
        return self

    def __len__(self) -> int:
        return self._size

    def take(self) -> bytes:
        """The oldest piece, removed; ``b""`` when there is none."""
        if not self._pieces:
            return b""
        piece = self._pieces.popleft()
        self._size -= len(piece)
        return piece


class WriteDeadline:
    """A connection's write clock: while it owes the client bytes, the client must take all it was
    sent within ``seconds`` of last having taken everything.

    It runs from a response's status line (:meth:`response_started`) and starts over each time the
    transport's buffer is empty again (:meth:`taken`: a write went out whole, or the client caught
    up). Between two pieces it keeps running while the app reads the next one or waits for memory
    to read it into, so an answer that cannot go on for ``seconds``, whatever the reason, ends.
    It stops once no response is under way and nothing is left unsent (:meth:`response_ended`,
    :meth:`taken`). When it runs out, ``expired`` is called.
    """

    __slots__ = ("_expired", "_loop", "_timer", "responding", "seconds")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]) -> None:
        self._loop = loop
        self.seconds = seconds
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None
        self.responding = False

    def response_started(self) -> None:
        """A status line went out: the rest of the answer is owed."""
        self.responding = True
        self._restart()

    def taken(self) -> None:
        """The client has taken everything written so far: the clock starts over, or stops."""
        if self.responding:
            self._restart()
        else:
            self.stop()

    def response_ended(self, unsent: bool) -> None:
        """The app sent the last of its answer; the clock runs on while ``unsent`` bytes are left."""
        self.responding = False
        if not unsent:
            self.stop()

    def stop(self) -> None:
        """Nothing is owed to the client any more (or the connection is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _restart(self) -> None:
        self.stop()
        self._timer = self._loop.call_later(self.seconds, self._run_out)

    def _run_out(self) -> None:
        self._timer = None
        self._expired()


class PiecewiseRequestCycle(RequestResponseCycle):
    """uvicorn's request cycle whose ``receive`` returns one queued body piece per call and whose
    ``send`` tells the connection's :class:`WriteDeadline` how the answer goes."""

    body: BodyPieces  # type: ignore[assignment]
    write_deadline: WriteDeadline | None = None
    #: The app reads the body from the socket itself (:mod:`service.api.http.socket_body`).
    socket_owned = False

    async def receive(self) -> ASGIReceiveEvent:
        """The next ASGI message: a body piece, the end of the body, or a disconnect."""
        if self.socket_owned:  # the body is the socket reader's: only the request's end is left to tell
            while not (self.disconnected or self.response_complete):
                self.message_event.clear()
                await self.message_event.wait()
            return {"type": "http.disconnect"}
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.body and not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
        # Whatever set the event (a piece, the body's end, a disconnect) is in the state read below.
        self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        piece = self.body.take()
        if len(self.body) <= httptools_impl.HIGH_WATER_LIMIT // 2:
            self.flow.resume_reading()  # refill while the app works through what is queued
        return {"type": "http.request", "body": piece, "more_body": bool(self.body) or self.more_body}

    async def send(self, message: ASGISendEvent) -> None:
        """uvicorn's send (it first waits until everything sent before is taken, then writes), then
        the write deadline learns whether the answer started, ended, or went out whole.

        A ``ckptstore.sendfile`` message (:mod:`service.api.http.sendfile`) has its file segments sent
        by the kernel, then counts as a body message without bytes."""
        if message["type"] == sendfile.EXTENSION:
            extension: Any = message
            seconds = self.write_deadline.seconds if self.write_deadline is not None else WRITE_TIMEOUT
            await sendfile.send_segments(self, extension["segments"], seconds, reset)
            message = {"type": "http.response.body", "body": b"", "more_body": bool(extension.get("more_body"))}
        await super().send(message)
        deadline = self.write_deadline
        if deadline is None or self.disconnected:
            return
        if message["type"] == "http.response.start":
            deadline.response_started()
        if self.response_complete:
            deadline.response_ended(unsent=self.flow.write_paused)
        elif not self.flow.write_paused:
            deadline.taken()


class WatchedFlow(FlowControl):
    """uvicorn's flow control, remembering whether reading was paused since the last look."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.paused_since_look = False

    def pause_reading(self) -> None:
        """Stop reading the socket (the request body buffered is at the high-water mark)."""
        super().pause_reading()
        self.paused_since_look = True

    def look(self) -> bool:
        """Whether reading is or was paused since the previous call."""
        paused = self.paused_since_look or self.read_paused
        self.paused_since_look = False
        return paused


def error_bytes(status: int, phrase: str, code: str, message: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 error response with a JSON ``{"code", "message"}`` body; it closes the connection."""
    body = json.dumps({"code": code, "message": message}).encode()
    lines = [f"HTTP/1.1 {status} {phrase}\r\n".encode()]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    lines += [
        b"content-type: application/json\r\n",
        b"x-error-code: " + code.encode() + b"\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
        body,
    ]
    return b"".join(lines)


class PiecewiseBodyProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with piecewise request bodies, read timeouts, a connection cap and JSON errors."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout = float(getattr(config, "header_timeout", HEADER_TIMEOUT))
        self.body_timeout = float(getattr(config, "body_timeout", BODY_TIMEOUT))
        self.min_body_rate = int(getattr(config, "min_body_rate", MIN_BODY_RATE))
        # uvicorn's own check answers in plain text and counts this connection against the cap.
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.request_begun = False
        self.window_bytes = 0
        #: Body bytes of the current request the parser has handed on.
        self.body_seen = 0
        self.write_timeout = float(getattr(config, "write_timeout", WRITE_TIMEOUT))
        self.write_deadline = WriteDeadline(self.loop, self.write_timeout, self.write_timed_out)

    # -- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start serving a connection; its first request's headers are due within header_timeout."""
        super().connection_made(transport)
        # Pause writing at the first byte the socket does not take, resume once all are taken: a
        # send then returns once the client has taken the piece before, and the write deadline
        # starts over when the client has caught up.
        # Over TLS the limits apply to asyncio's SSL layer, which never resumes a writer paused at
        # 0 bytes: there uvicorn's own limits stay (the write deadline still runs from them).
        if transport.get_extra_info("ssl_object") is None:
            transport.set_write_buffer_limits(high=0)
        self.flow = WatchedFlow(transport)
        self.header_timer = self.loop.call_later(self.header_timeout, self.headers_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection's timers, then let uvicorn clean up."""
        self.cancel_timers()
        super().connection_lost(exc)

    def cancel_timers(self) -> None:
        """Stop both read timers and the write deadline."""
        for timer in (self.header_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.header_timer = self.body_timer = None
        self.write_deadline.stop()

    def refuse(self, status: int, phrase: str, code: str, message: str) -> None:
        """Answer with a JSON error and close, unless a response is under way (then only close)."""
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            if self.cycle is not None and not self.cycle.response_complete:
                # The app's own answer, if it comes, must not follow this one on the wire.
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.write(error_bytes(status, phrase, code, message, self.server_state.default_headers))
        self.transport.close()

    # -- read timeouts -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        """A request's first byte: its headers are due within header_timeout (if not already)."""
        super().on_message_begin()
        self.request_begun = True
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout, self.headers_timed_out)

    def headers_timed_out(self) -> None:
        """Close a connection whose request headers did not all arrive in time."""
        self.header_timer = None
        if self.transport.is_closing():
            return
        self.logger.warning(
            "closed a connection from %s: no complete request headers in %g s", self.peer(), self.header_timeout
        )
        if not self.request_begun:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        message = f"the request's headers did not arrive within {self.header_timeout:g} seconds"
        self.refuse(408, "Request Timeout", "request_timeout", message)

    def on_headers_complete(self) -> None:
        """Headers in: stop their timer, start the body's, apply the cap, then let uvicorn go on."""
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        self.request_begun = False
        app = self.app
        if self.max_connections is not None and (
            len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections
        ):
            self.logger.warning(
                "answered 503: %d connections are open, at most %d are served",
                len(self.connections),
                self.max_connections,
            )
            self.app = self.over_capacity
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        adopt(self.cycle, self.write_deadline)
        self.body_seen = 0
        if isinstance(self.cycle, PiecewiseRequestCycle):
            offer(self, self.cycle)
            sendfile.offer(self.transport, self.cycle.scope)
        self.start_body_window()

    async def over_capacity(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app for a request past the connection cap: 503 in JSON, connection closed."""
        body = json.dumps(
            {
                "code": "unavailable",
                "message": f"the server has {self.max_connections} connections open, its limit; retry shortly",
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"x-error-code", b"unavailable"),
            (b"retry-after", b"1"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def start_body_window(self) -> None:
        """Start a window of body_timeout seconds in which the body must bring min_body_rate bytes a second."""
        if self.body_timer is not None:
            self.body_timer.cancel()
        self.window_bytes = 0
        self.flow.look()  # type: ignore[attr-defined]
        self.body_timer = self.loop.call_later(self.body_timeout, self.body_window_ended)

    def on_body(self, body: bytes) -> None:
        """Count a piece of body (even one the app no longer wants), then let uvicorn queue it."""
        self.window_bytes += len(body)
        self.body_seen += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The body is complete: no more timer for it."""
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        super().on_message_complete()

    def body_window_ended(self) -> None:
        """Close the connection if the body came too slowly over the window just ended."""
        self.body_timer = None
        if self.transport.is_closing():
            return
        paused = self.flow.look()  # type: ignore[attr-defined]
        waiting = self.cycle is not None and self.cycle.waiting_for_100_continue
        if paused or waiting or self.window_bytes >= self.min_body_rate * self.body_timeout:
            self.start_body_window()
            return
        self.logger.warning(
            "closed a connection from %s: %d bytes of request body in %g s, below %d bytes a second",
            self.peer(),
            self.window_bytes,
            self.body_timeout,
            self.min_body_rate,
        )
        message = (
            f"the request body brought {self.window_bytes} bytes in {self.body_timeout:g} seconds; "
            f"the server needs at least {self.min_body_rate} bytes a second"
        )
        self.refuse(408, "Request Timeout", "request_timeout", message)

    # -- write timeout -----------------------------------------------------------------------

    def resume_writing(self) -> None:
        """The client has taken everything written: resume the app's sends, start the clock over."""
        super().resume_writing()
        self.write_deadline.taken()

    def write_timed_out(self) -> None:
        """Reset a connection whose answer made no progress for write_timeout seconds."""
        unsent = self.transport.get_write_buffer_size()
        if unsent:
            reason = f"it did not take the {unsent} bytes it was sent"
        else:  # the app had nothing to send: it waited for memory (max_unsent_bytes) or for storage
            reason = "its answer had nothing new to send"
        self.logger.warning("closed a connection from %s: %s within %g s", self.peer(), reason, self.write_timeout)
        reset(self.transport)

    def peer(self) -> str:
        """The client's address, for log lines."""
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    # -- uvicorn's own error -----------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """Answer a request the parser refused, in JSON (called while the parser's error is handled)."""
        error = sys.exc_info()[1]
        detail = f" ({error})" if error is not None and str(error) else ""
        message = f"malformed HTTP request{detail}: the request line or a header is not valid HTTP/1.1"
        self.cancel_timers()
        response = error_bytes(400, "Bad Request", "invalid_input", message, self.server_state.default_headers)
        self.transport.write(response)
        self.transport.close()


def adopt(cycle: RequestResponseCycle | None, write_deadline: WriteDeadline) -> None:
    """Make a request cycle uvicorn has just built (no body received yet) piecewise, its
    response under the connection's ``write_deadline``.

    The cycle's ASGI task may be created already but has not run: this is called from the
    parser's callback, before the event loop gets control back.
    """
    if type(cycle) is RequestResponseCycle and isinstance(cycle.body, bytearray) and not cycle.body:
        cycle.__class__ = PiecewiseRequestCycle
        cycle.body = BodyPieces()  # type: ignore[assignment]
        cycle.write_deadline = write_deadline  # type: ignore[attr-defined]


def reset(transport: asyncio.Transport) -> None:
    """Close a connection at once with a TCP reset: what the transport buffers is dropped, and so is
    what the kernel holds for the peer (a plain close would keep both until a client that reads
    nothing took them, which is never)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed underneath: abort alone will do
    transport.abort()
