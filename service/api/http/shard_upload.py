"""Receiving a shard upload: stream the body through a ShardReceiver, then store it.

The body is never held in memory. A large one is received from the socket straight into the
staging file's write buffers (:mod:`service.api.http.socket_body`); otherwise chunks are batched to a
few MiB. Either way they go to the engine's :class:`service.intake.receiver.ShardReceiver` off the
event loop, which checks the header (and the shard id the URL names) as soon as it is
complete, hashes every tensor as its bytes pass and writes them to a staging file. A body that
is cut short, too long, sent under another id or wrong leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ckptstore.service.api.http.socket_body import SocketBody
from ckptstore.service.errors import InvalidInputError, PayloadTooLargeError
from ckptstore.service.format.records import ShardReceipt, TensorsReceipt
from ckptstore.service.store import Store

WRITE_BYTES = 4 << 20


class Receiving(Protocol):
    """An upload's receiver: :class:`ShardReceiver` or :class:`UnhashedReceiver`."""

    received: int

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def space(self) -> memoryview: ...

    def landed(self, nbytes: int) -> None: ...

    def discard(self) -> None: ...


async def receive_shard(
    store: Store,
    shard_id: str,
    body: AsyncIterator[bytes],
    declared_length: str | None,
    max_bytes: int,
    socket_body: SocketBody | None = None,
    *,
    save_key: str | None = None,
) -> ShardReceipt:
    """Store the streamed shard whose id must be ``shard_id``: its bytes come from ``socket_body``
    where the server offers it, else from ``body``; held for the save ``save_key`` names."""
    if declared_length is not None and _declared(declared_length) > max_bytes:
        raise PayloadTooLargeError(f"shard of {declared_length} bytes exceeds the limit of {max_bytes}")
    receiver = store.receiver(expected_id=shard_id, max_bytes=max_bytes, write_behind=True)
    await _fill(receiver, body, declared_length, socket_body)
    return await run_in_threadpool(lambda: store.ingest_received(receiver, save_key=save_key))


async def receive_unhashed(
    store: Store,
    body: AsyncIterator[bytes],
    declared_length: str | None,
    max_bytes: int,
    socket_body: SocketBody | None,
    *,
    save_key: str | None = None,
) -> TensorsReceipt:
    """Store the streamed tensors of an unhashed upload (:mod:`service.intake.unhashed_receiver`): the
    store hashes each as it writes it; the receipt carries the digests. Held for ``save_key``'s save."""
    if declared_length is None:
        raise InvalidInputError("an upload of unhashed tensors needs a Content-Length")
    if _declared(declared_length) > max_bytes + store.max_header_bytes:
        raise PayloadTooLargeError(f"an upload of {declared_length} bytes exceeds the limit of {max_bytes}")
    receiver = store.intake.unhashed_receiver(length=int(declared_length), max_bytes=max_bytes)
    await _fill(receiver, body, declared_length, socket_body)
    receipt, digests = await run_in_threadpool(lambda: store.intake.store_unhashed(receiver, save_key=save_key))
    return TensorsReceipt(shard=receipt, digests=digests)


def _declared(declared_length: str) -> int:
    """The Content-Length as a byte count (InvalidInputError if it is not one)."""
    if not declared_length.isdigit():
        raise InvalidInputError(f"Content-Length {declared_length[:40]!r} is not a byte count")
    return int(declared_length)


async def _fill(
    receiver: Receiving, body: AsyncIterator[bytes], declared_length: str | None, socket_body: SocketBody | None
) -> None:
    """Give ``receiver`` the whole body, from the socket where offered (its length is the declared
    one), else streamed; on any error its staging file is removed."""
    try:
        if socket_body is not None:
            await socket_body.read_into(receiver)
        else:
            await _stream(receiver, body, declared_length)
    except BaseException:
        receiver.discard()
        raise


async def _stream(receiver: Receiving, body: AsyncIterator[bytes], declared_length: str | None) -> None:
    """Feed the body's chunks to ``receiver`` in batches of WRITE_BYTES, on worker threads."""
    pending: list[bytes] = []
    pending_bytes = 0
    try:
        async for chunk in body:
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes >= WRITE_BYTES:
                await run_in_threadpool(_write_all, receiver, pending)
                pending, pending_bytes = [], 0
    except ClientDisconnect as exc:
        received = receiver.received + pending_bytes
        raise InvalidInputError(f"the upload was cut off after {received} bytes; retry it") from exc
    await run_in_threadpool(_write_all, receiver, pending)
    if declared_length is not None and receiver.received != int(declared_length):
        raise InvalidInputError(f"received {receiver.received} bytes but Content-Length said {declared_length}")


def _write_all(receiver: Receiving, chunks: list[bytes]) -> None:
    """Feed a batch of chunks to the receiver, in order, on a worker thread."""
    for chunk in chunks:
        receiver.write(chunk)
