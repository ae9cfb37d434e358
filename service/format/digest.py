"""Tensor and shard digests (BLAKE3, 64 lowercase hex characters).

A tensor's digest covers its dtype, its shape and its raw little-endian bytes:

    BLAKE3( ascii("<DTYPE>[<d0>,<d1>,...]\\n") || bytes )

so two tensors with equal bytes but different shapes or dtypes never share a digest.
A shard's id is the BLAKE3 of its header (the 8-byte length prefix and the JSON text);
the header names every tensor by its digest and the ingest check hashes each tensor's
bytes, so together they pin every byte of the file.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import blake3

ALGORITHM = "blake3"
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
_DIGEST_RE = re.compile(DIGEST_PATTERN)


def is_digest(value: object) -> bool:
    """True if ``value`` is a well-formed digest string (64 lowercase hex characters)."""
    return isinstance(value, str) and len(value) == 64 and _DIGEST_RE.match(value) is not None


_DIGEST_LINES_RE = re.compile(r"(?:[0-9a-f]{64}\n)*")


def all_digests(values: Sequence[object]) -> bool:
    """True if every one of ``values`` is a well-formed digest: one regex pass over them all,
    where checking each on its own cost a microsecond a digest."""
    # Every value a string of exactly 64 characters, so each takes one 65-character line.
    if not all(type(value) is str and len(value) == 64 for value in values):
        return False
    text = "\n".join(values) + "\n"  # type: ignore[arg-type]
    return not values or _DIGEST_LINES_RE.fullmatch(text) is not None


def tensor_preamble(dtype: str, shape: Sequence[int]) -> bytes:
    """The bytes hashed before a tensor's data: its dtype name and shape."""
    return _preamble(dtype, tuple(shape))


@functools.lru_cache(maxsize=4096)
def _preamble(dtype: str, shape: tuple[int, ...]) -> bytes:
    # A model's tensors share a few shapes: formatting each anew was a tenth of hashing a
    # small tensor.
    return f"{dtype}[{','.join(str(int(d)) for d in shape)}]\n".encode("ascii")


#: A first piece up to this size is hashed in one call with the preamble in front of it (a copy).
JOIN_BYTES = 256 << 10


class TensorHasher:
    """Incremental digest of one tensor; feed its bytes in order with :meth:`update`.

    The preamble waits for the first piece: hashed on its own, it leaves BLAKE3 in the middle
    of its first 1 KiB chunk, and every following chunk is then hashed in small, unaligned
    batches (a 32 KiB tensor took 2.5 times as long). A small first piece is copied behind the
    preamble and hashed in one call instead; a large one is hashed after it as before, where
    the few unaligned batches at its start do not matter.
    """

    __slots__ = ("_hasher", "_preamble", "_threads")

    def __init__(self, dtype: str, shape: Sequence[int], *, parallel: bool = True) -> None:
        # BLAKE3 only spreads an update over threads when the piece is large enough. Callers
        # feeding many small pieces (a request body) hash on one thread: it is cheaper then.
        self._threads = blake3.blake3.AUTO if parallel else 1
        self._preamble: bytes | None = tensor_preamble(dtype, shape)
        self._hasher: blake3.blake3 | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add the next piece of the tensor's raw bytes."""
        if self._hasher is not None:
            self._hasher.update(data)
            return
        preamble, self._preamble = self._preamble or b"", None
        if memoryview(data).nbytes <= JOIN_BYTES:  # too small to gain from threads
            self._hasher = blake3.blake3(preamble + data)
        else:
            self._hasher = blake3.blake3(preamble, max_threads=self._threads)
            self._hasher.update(data)

    def hexdigest(self) -> str:
        """The digest of everything fed so far."""
        if self._hasher is None:
            return blake3.blake3(self._preamble or b"").hexdigest()
        return self._hasher.hexdigest()


def tensor_digest(
    dtype: str, shape: Sequence[int], data: bytes | bytearray | memoryview, *, parallel: bool = True
) -> str:
    """Digest of a whole tensor held in ``data``, using every core for large tensors unless not ``parallel``."""
    nbytes = data.nbytes if type(data) is memoryview else memoryview(data).nbytes
    if nbytes <= JOIN_BYTES:  # most tensors of a large model: one call, no hasher
        return blake3.blake3(_preamble(dtype, tuple(shape)) + data).hexdigest()
    hasher = TensorHasher(dtype, shape, parallel=parallel)
    hasher.update(data)
    return hasher.hexdigest()


def shard_id(header_bytes: bytes | memoryview) -> str:
    """Content address of a shard: the digest of its length prefix and header text."""
    return blake3.blake3(header_bytes).hexdigest()
