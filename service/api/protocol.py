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
"""

from __future__ import annotations

from collections import deque

from uvicorn._types import ASGIReceiveEvent
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


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


class PiecewiseRequestCycle(RequestResponseCycle):
    """uvicorn's request cycle whose ``receive`` returns one queued body piece per call."""

    body: BodyPieces  # type: ignore[assignment]

    async def receive(self) -> ASGIReceiveEvent:
        """The next ASGI message: a body piece, the end of the body, or a disconnect."""
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


class PiecewiseBodyProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose request cycles are :class:`PiecewiseRequestCycle`."""

    def on_headers_complete(self) -> None:
        """Let uvicorn build the request's cycle, then give it a piecewise body."""
        super().on_headers_complete()
        adopt(self.cycle)


def adopt(cycle: RequestResponseCycle | None) -> None:
    """Make a request cycle uvicorn has just built (no body received yet) piecewise.

    The cycle's ASGI task may be created already but has not run: this is called from the
    parser's callback, before the event loop gets control back.
    """
    if type(cycle) is RequestResponseCycle and isinstance(cycle.body, bytearray) and not cycle.body:
        cycle.__class__ = PiecewiseRequestCycle
        cycle.body = BodyPieces()  # type: ignore[assignment]
