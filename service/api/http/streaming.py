"""Streamed answers of blob bytes, their memory bounded per connection and across the server.

Shard downloads, range batches and the pages' tensor downloads send blob bytes piece by piece:
each piece is read from blob storage into a buffer of its own, handed to uvicorn, and held
until the client's socket has taken it. A client that stops reading keeps what was read for it:
before, a 4 MiB piece waiting in uvicorn's transport and the next one read meanwhile, 8 MiB a
client, counted nowhere: 100 of them asking for 256 MiB each took the server from 150 to 970 MB
(and kept it, having no write timeout). Now:

- a piece is at most :data:`PIECE_BYTES`, and the next is read while the client takes the one
  before, never further ahead (:mod:`service.api.http.protocol` makes ``send`` return only once
  everything sent before is taken): two pieces at most per connection;
- before it is read, every piece takes its size from the server's :class:`ByteBudget`
  (``max_unsent_bytes``), given back once the client has taken it. Past the budget a response
  waits on the event loop, holding no thread and no buffer, for others to take theirs. After
  the status line that wait runs on the write deadline, like a client's slowness; the first
  piece, read before answering so that an unreadable blob is a proper error and not a 200 cut
  short, waits at most ``write_timeout`` seconds, and then the answer is 503 ``unavailable``;
- a thread of the pool is used for the read alone: a client that stops reading holds none.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator, Mapping

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ckptstore.service.errors import ServerBusyError

#: The most bytes a streamed answer reads from blob storage at a time; it holds two at most. A
#: client must take what it was sent within the write timeout: 1 MiB in 30 s, about 35 KB a second.
PIECE_BYTES = 1 << 20


class ByteBudget:
    """Bytes that may be held at once, handed out first come, first served: a semaphore of bytes.

    :meth:`take` waits on the event loop until the bytes asked for are free and every earlier
    request has been served; :meth:`give` returns them. A request for more than the whole budget
    waits until all of it is free. Used from one event loop (each worker process has its own).
    """

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a byte budget needs at least one byte, not {total}")
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def held(self) -> int:
        """Bytes taken and not given back."""
        return self.total - self.free

    async def take(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (at most the whole budget) are free and take them; returns how many.

        Cancelled while waiting, it takes nothing (bytes granted just as it was cancelled go back).
        """
        nbytes = min(nbytes, self.total)
        if not self._waiting and nbytes <= self.free:
            self.free -= nbytes
            return nbytes
        turn = (nbytes, asyncio.get_running_loop().create_future())
        self._waiting.append(turn)
        try:
            await turn[1]
        except asyncio.CancelledError:
            if turn[1].done() and not turn[1].cancelled():
                self.give(nbytes)
            else:
                if turn in self._waiting:  # _serve may have dropped it already
                    self._waiting.remove(turn)
                self._serve()  # a smaller request behind this one may fit now
            raise
        return nbytes

    def give(self, nbytes: int) -> None:
        """Return ``nbytes`` taken before, and serve whoever waits, in order, while they fit."""
        self.free += nbytes
        self._serve()

    def _serve(self) -> None:
        while self._waiting:
            nbytes, granted = self._waiting[0]
            if granted.cancelled():  # its task is cancelled but has not run yet: it takes nothing
                self._waiting.popleft()
            elif nbytes <= self.free:
                self._waiting.popleft()
                self.free -= nbytes
                granted.set_result(None)
            else:
                return


class BlobStream(StreamingResponse):
    """An ``application/octet-stream`` answer read piece by piece under a :class:`ByteBudget`.

    Built by :meth:`Streamer.open` with its first piece read (``held`` bytes of the budget).
    The next piece is read while the client takes the one before, so two pieces at most are
    held, both counted: the protocol's ``send`` first waits until everything sent before is
    taken, so once it returns the piece before is gone. Starlette's StreamingResponse around it
    ends the stream when the client disconnects (the protocol's write timeout included);
    whatever the end, the budget is given back and the source closed.
    """

    def __init__(
        self,
        pieces: Iterator[bytes | memoryview],
        first: bytes | memoryview,
        held: int,
        budget: ByteBudget,
        status_code: int,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__((), status_code, headers, media_type="application/octet-stream")
        self._pieces = pieces
        self._first = first
        self._budget = budget
        self._held = held  # the bytes of the piece being read, or about to be sent
        self._handed = 0  # the bytes of the piece last sent, which the client may not have taken yet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the answer; whatever ends it (the last piece, a disconnect, a cancellation before
        the first byte), give back the bytes still held and close the source."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._budget.give(self._held + self._handed)
            self._held = self._handed = 0
            close_source(self._pieces)

    async def stream_response(self, send: Send) -> None:
        """The status line, then each piece, read while the client takes the one before."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        piece, self._first = self._first, b""
        while piece:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            piece = b""  # the transport holds it until it is taken; the source keeps no reference
            self._budget.give(self._handed)  # send returned: the piece before this one is taken
            self._handed, self._held = self._held, 0
            self._held = await self._budget.take(PIECE_BYTES)
            piece, self._held = await read_piece(self._pieces, self._budget, self._held)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_piece(
    pieces: Iterator[bytes | memoryview], budget: ByteBudget, held: int
) -> tuple[bytes | memoryview, int]:
    """The next of ``pieces`` (``b""`` at the end), read in the thread pool into the ``held``
    bytes taken from ``budget``, and how many of them it keeps (the rest go back)."""
    piece = await run_in_threadpool(next, pieces, b"")
    if len(piece) < held:
        budget.give(held - len(piece))
        held = len(piece)
    return piece, held


def close_source(pieces: Iterator[bytes | memoryview]) -> None:
    """Close a generator of pieces (a blob store's open file or S3 response) left unfinished."""
    close = getattr(pieces, "close", None)
    if close is not None:
        close()


class Streamer:
    """Opens the application's streamed answers: one :class:`ByteBudget` of ``max_unsent_bytes``,
    and ``write_timeout`` seconds for a first piece to get room in it."""

    def __init__(self, max_unsent_bytes: int, write_timeout: float) -> None:
        self.budget = ByteBudget(max_unsent_bytes)
        self.write_timeout = write_timeout

    async def open(
        self, pieces: Iterator[bytes | memoryview], status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> BlobStream:
        """The answer streaming ``pieces`` (each at most :data:`PIECE_BYTES`), its first piece read.

        The first piece is read before the status line goes out, so a blob that cannot be read
        (deleted meanwhile, storage down) is a proper error response, not a 200 cut off mid-body.

        Raises:
            ServerBusyError: the budget had no room for the first piece within ``write_timeout``.
            Whatever reading the first piece raises.
        """
        try:
            try:
                async with asyncio.timeout(self.write_timeout):
                    held = await self.budget.take(PIECE_BYTES)
            except TimeoutError:
                raise ServerBusyError(
                    f"the server already holds {self.budget.total} bytes of answers its clients have not taken "
                    f"yet (its limit, CKPTSTORE_MAX_UNSENT_BYTES) and no room came free within "
                    f"{self.write_timeout:g} s; retry shortly"
                ) from None
            try:
                first, held = await read_piece(pieces, self.budget, held)
            except BaseException:
                self.budget.give(held)
                raise
        except BaseException:
            close_source(pieces)
            raise
        return BlobStream(pieces, first, held, self.budget, status_code, headers or {})
