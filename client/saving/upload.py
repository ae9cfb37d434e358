"""Sending a save's missing tensors as shards, a few at a time, while the caller goes on hashing.

Tensors are added in the order the save finds them missing and packed into shards by
:class:`client.saving.plan.SeparatePacker`, frozen tensors never beside trainable ones (so each
kind's shards are reclaimed with the versions that use them); each closed shard goes to the store on a worker
thread straight from tensor memory. At most
``in_flight`` shards are sent at once; adding more waits for the oldest. The shards of small
tensors sent together go beside those, on threads of their own.

An embedded store also takes tensors not hashed yet (:meth:`ShardUploader.add_unhashed`): it
hashes them as it writes them and hands back their digests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ckptstore.client.saving.gather import byte_views
from ckptstore.client.saving.plan import SeparatePacker, balanced_shard_bytes
from ckptstore.client.saving.shards import build_shard
from ckptstore.client.store_protocol import Transport
from ckptstore.client.tensors import dtype_name
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.sharding import UnhashedTensor


class ShardUploader:
    """Groups ``(digest, key, tensor)`` items into shards and sends them in the background.

    Use as a context manager: leaving it by an exception cancels shards not yet started and
    waits for those being sent.

    Args:
        transport: where shards go (``put_shard``).
        shard_bytes: target shard size.
        on_bytes: progress callback, given each tensor's size as it is stored.
        in_flight: shards sent at the same time.
        save_key: the save the shards are part of (its commit key): the store holds their
            tensors for it until it commits.
    """

    def __init__(
        self,
        transport: Transport,
        shard_bytes: int,
        on_bytes: Callable[[int], object] | None = None,
        in_flight: int = 2,
        save_key: str | None = None,
    ) -> None:
        self.transport = transport
        self.save_key = save_key
        self.shard_bytes = shard_bytes
        self.on_bytes = on_bytes
        self.in_flight = in_flight
        self.stored = 0
        self.shards = 0
        #: Digests of the tensors given to :meth:`add_unhashed`, by their ``index``, as their shards are stored.
        self.digests: dict[int, str] = {}
        # Two threads more: the shards of small tensors sent together, one per kind (:meth:`flush_together`).
        self._pool = ThreadPoolExecutor(in_flight + 2, thread_name_prefix="ckptstore-upload")
        self._sending: deque[Future[ShardReceipt]] = deque()
        self._beside: list[Future[ShardReceipt]] = []
        self._packer: SeparatePacker[tuple[str, str, torch.Tensor]] = SeparatePacker(shard_bytes)
        self._unhashed: SeparatePacker[tuple[int, str, torch.Tensor, int]] = SeparatePacker(shard_bytes)
        self._together: SeparatePacker[tuple[int, str, torch.Tensor, int]] = SeparatePacker(shard_bytes)

    def __enter__(self) -> ShardUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in [*self._sending, *self._beside]:
            future.cancel()
        self._pool.shutdown(wait=True)

    def add(self, digest: str, key: str, tensor: torch.Tensor, nbytes: int, *, frozen: bool = False) -> None:
        """Queue one tensor (of ``nbytes`` bytes, more than zero) for the current shard of its
        kind: ``frozen`` (saved with ``trainable`` False) or not."""
        closed = self._packer.add((digest, key, tensor), nbytes, frozen)
        if closed is not None:
            self._send(closed)

    def balance_unhashed(self, total: int) -> int:
        """Cut the ``total`` bytes about to be given to :meth:`add_unhashed` into shards of about
        equal size, a whole number of rounds of ``in_flight`` (:func:`balanced_shard_bytes`);
        returns that size."""
        size = balanced_shard_bytes(total, self.shard_bytes, self.in_flight)
        self._unhashed = SeparatePacker(size, fill=True)
        return size

    def add_unhashed(
        self, index: int, key: str, tensor: torch.Tensor, nbytes: int, *, frozen: bool = False, together: bool = False
    ) -> None:
        """Queue one tensor whose digest is not known (the transport must ``takes_unhashed``);
        it appears in :attr:`digests` under ``index`` once stored. ``frozen`` as for :meth:`add`.

        ``together``: a small tensor that may equal another of this save; the tensors so marked
        go in one shard per kind (up to ``MAX_TENSORS_PER_SHARD`` and the shard size: the saver marks
        a kind's small tensors only when they fit one), in which the store writes equal tensors once.
        """
        packer = self._together if together else self._unhashed
        closed = packer.add((index, key, tensor, nbytes), nbytes, frozen)
        if closed is not None:
            self._send_unhashed(closed)

    def flush_together(self) -> None:
        """Start sending the shards of the tensors given ``together`` so far, beside the
        ``in_flight`` shards rather than in one of their turns, without waiting: a shard of small
        tensors sent after the large ones waited for a free turn and then took a round trip of
        its own."""
        for shard in self._together.flush():
            self._beside.append(self._pool.submit(self._unhashed_sender(shard)))
            self.shards += 1

    def flush(self) -> None:
        """Start sending the shards being filled, without waiting for them."""
        for last in self._packer.flush():
            self._send(last)
        for unhashed in [*self._unhashed.flush(), *self._together.flush()]:
            self._send_unhashed(unhashed)

    def finish(self) -> tuple[int, int]:
        """Send what is queued, wait for every shard; returns (bytes stored, shards sent)."""
        self.flush()
        while self._sending:
            self._collect()
        while self._beside:
            self.stored += self._beside.pop(0).result().size
        return self.stored, self.shards

    def _send(self, items: list[tuple[str, str, torch.Tensor]]) -> None:
        shard = build_shard(items)
        key = self.save_key
        self._submit(lambda: self.transport.put_shard(shard.header, shard.pieces, self.on_bytes, save_key=key))

    def _send_unhashed(self, items: list[tuple[int, str, torch.Tensor, int]]) -> None:
        self._submit(self._unhashed_sender(items))

    def _unhashed_sender(self, items: list[tuple[int, str, torch.Tensor, int]]) -> Callable[[], ShardReceipt]:
        """What sends ``items`` as one shard of unhashed tensors (their bytes gathered now)."""
        store = self.transport  # it took tensors unhashed when the save was planned (a server may stop)
        views = byte_views([(key, tensor, nbytes) for _, key, tensor, nbytes in items])
        tensors = [
            UnhashedTensor(dtype_name(tensor, key), tuple(tensor.shape), view)
            for (_, key, tensor, _), view in zip(items, views, strict=True)
        ]

        def put() -> ShardReceipt:
            receipt, digests = store.put_tensors(tensors, self.on_bytes, save_key=self.save_key)
            for (index, _, _, _), digest in zip(items, digests, strict=True):
                self.digests[index] = digest
            return receipt

        return put

    def _submit(self, send: Callable[[], ShardReceipt]) -> None:
        while len(self._sending) >= self.in_flight:
            self._collect()
        self._sending.append(self._pool.submit(send))
        self.shards += 1

    def _collect(self) -> None:
        self.stored += self._sending.popleft().result().size
