"""Loading tensors stored encoded (``gc --compress``): fetch their payloads, decode on every core, hash.

A tensor stored encoded (:mod:`service.format.encoding`) cannot be read straight into its
destination: its payload, and for a delta those of its bases, are read into memory, then decoded
into the destination block by block, a large tensor's blocks spread over a pool of threads
(zstd and numpy release the interpreter), and the result hashed against the digest as every
other tensor is. Several tensors are on their way at once, a bounded number ahead of the one
handed out.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

from ckptstore.client.loading.read_hints import ReadHints, WillRead
from ckptstore.client.loading.readahead import run_ahead
from ckptstore.service.errors import IntegrityError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.encoded_reads import ReadInto, decode_into, fetch_chain
from ckptstore.service.format.records import TensorLocation

#: Blocks (of 1 MiB) one thread decodes at a time: a tensor of more is spread over the pool.
SPLIT_BLOCKS = 16


def decode_threads(cores: int | None = None) -> int:
    """Threads decoding at once: one per core, up to 16."""
    return max(1, min(16, cores if cores is not None else os.cpu_count() or 1))


class EncodedJob(Protocol):
    """A tensor on its way: the keys it serves, where it is stored, its dtype and shape, and its
    destination's bytes."""

    @property
    def keys(self) -> Sequence[str]: ...
    @property
    def location(self) -> TensorLocation: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    def bytes(self) -> memoryview: ...


@dataclass
class _Decoding:
    """One tensor's destination bytes, and the digest of what was decoded into them once done."""

    view: memoryview
    digest: str = ""


def decoded(
    read: ReadInto,
    locations: Mapping[str, TensorLocation],
    jobs: Sequence[EncodedJob],
    *,
    threads: int,
    will_read: WillRead | None = None,
) -> Generator[tuple[EncodedJob, str], None, None]:
    """Yield each of ``jobs`` in order with the digest of the bytes decoded into its destination.

    The caller compares the digest with the one the job was stored under. Given ``will_read``
    (a transport's hint), the payloads of the next jobs are announced a window ahead
    (:mod:`client.loading.read_hints`). However the consumer stops, queued work is cancelled
    and running work waited for.

    Raises:
        IntegrityError: a payload is corrupt or does not fit its tensor (named by its first key).
    """
    blocks_pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptstore-decode-blocks")

    def decode(job: EncodedJob, out: _Decoding) -> None:
        chain = fetch_chain(read, locations, job.location.digest)
        view = out.view
        if chain.blocks <= SPLIT_BLOCKS:
            decode_into(read, chain, view)
        else:
            spans = [range(i, min(i + SPLIT_BLOCKS, chain.blocks)) for i in range(0, chain.blocks, SPLIT_BLOCKS)]
            for future in [blocks_pool.submit(decode_into, read, chain, view, blocks=span) for span in spans]:
                future.result()
        # Hashed here, by the thread that decoded it while it is in its cache, not by the consumer.
        out.digest = tensor_digest(job.dtype, job.shape, view, parallel=threads == 1)

    hints = ReadHints(will_read, locations, [job.location.digest for job in jobs]) if will_read else None

    def views_for(number: int, job: EncodedJob) -> _Decoding:
        if hints is not None:
            hints.reach(number)
        return _Decoding(job.bytes())

    try:
        work = run_ahead(decode, jobs, views_for, ahead=2 * threads, threads=threads, name="ckptstore-decode")
        with closing(work):
            for job, done, future in work:
                try:
                    future.result()
                except IntegrityError as exc:
                    raise IntegrityError(f"{job.keys[0]}: {exc}") from exc
                yield job, done.digest
    finally:
        blocks_pool.shutdown(wait=True, cancel_futures=True)
        if hints is not None:
            hints.close()


__all__ = ["SPLIT_BLOCKS", "EncodedJob", "decode_threads", "decoded"]
