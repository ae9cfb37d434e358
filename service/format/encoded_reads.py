"""Reading a stored tensor's raw bytes whatever its encoding: a payload, a delta chain, or raw.

A tensor stored encoded (:mod:`service.format.encoding`) is decoded from its own payload and,
for a delta, from those of its bases down to a tensor stored whole. This module resolves that
chain from located tensors (:meth:`Store.locate` returns a delta's bases with it), reads the
payloads through any ``read(shard_id, offset, buffer)`` (the blob store, or a client's
transport) and decodes them; the client's loads and the store's own readers share it.

A payload's length comes from the store: it is checked against the most a payload of the
tensor can take before anything is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ckptstore.service.errors import IntegrityError
from ckptstore.service.format.digest import TensorHasher, tensor_digest
from ckptstore.service.format.dtypes import itemsize
from ckptstore.service.format.encoding import (
    PayloadHead,
    block_count,
    check_chain,
    decode_block_frames,
    decode_chain,
    frame_count,
    head_bytes,
    parse_head,
)
from ckptstore.service.format.records import TensorLocation

#: Reads ``len(buffer)`` bytes of a shard from an offset into ``buffer``.
ReadInto = Callable[[str, int, memoryview], None]
#: Longest chain followed (gc writes deltas one link deep, on a keyframe stored whole).
MAX_CHAIN = 16
#: Largest block :func:`iter_decoded` decodes (gc writes blocks of 1 MiB): what it holds at once.
MAX_STREAMED_BLOCK = 16 << 20


def subject(location: TensorLocation) -> str:
    """How errors name a stored tensor: its digest and shard, shortened."""
    return f"tensor {location.digest[:16]}… in shard {location.shard_id[:16]}…"


def most_payload_bytes(nbytes: int) -> int:
    """The longest payload a tensor of ``nbytes`` raw bytes may have (zstd's worst case, and the header)."""
    return nbytes + nbytes // 128 + 64 * block_count(nbytes) + head_bytes(block_count(nbytes)) + 64


def chain_of(locations: Mapping[str, TensorLocation], digest: str) -> list[TensorLocation]:
    """The located tensors decoding ``digest`` reads: its own, then each base in turn, down to
    one with no base.

    Raises:
        IntegrityError: a base was not located, the chain loops or is longer than :data:`MAX_CHAIN`,
            or a base differs from the tensor in dtype or shape.
    """
    location = locations[digest]
    chain = [location]
    while chain[-1].base is not None:
        base = locations.get(chain[-1].base)
        if base is None:
            raise IntegrityError(f"{subject(chain[-1])}: its delta base {chain[-1].base} was not located")
        if len(chain) > MAX_CHAIN or any(link.digest == base.digest for link in chain):
            raise IntegrityError(f"{subject(location)}: its delta chain loops or is deeper than {MAX_CHAIN}")
        if base.dtype != location.dtype or base.nbytes != location.nbytes:
            raise IntegrityError(f"{subject(location)}: its delta base {base.digest[:16]}… has another dtype or size")
        chain.append(base)
    return chain


@dataclass(frozen=True)
class Chain:
    """The payloads decoding one tensor reads (its own first), and the location of the raw
    tensor at the bottom when the last delta's base is stored raw."""

    location: TensorLocation
    links: tuple[tuple[PayloadHead, bytearray], ...]
    raw_base: TensorLocation | None

    @property
    def blocks(self) -> int:
        """How many blocks the tensor decodes in (each independently of the others)."""
        return len(self.links[0][0].frames)


def fetch_chain(read: ReadInto, locations: Mapping[str, TensorLocation], digest: str) -> Chain:
    """Read every payload decoding ``digest`` needs and check each one's header.

    Raises:
        IntegrityError: a payload is longer than such a tensor's can be, or its header does not
            fit the tensor (see :func:`~service.format.encoding.parse_head`) or its place in the chain.
    """
    chain = chain_of(locations, digest)
    links = []
    raw_base = None
    for link in chain:
        if not link.encoded:
            raw_base = link
            break
        _check_length(link)
        payload = bytearray(link.length)
        read(link.shard_id, link.offset, memoryview(payload))
        links.append((_checked_head(link, payload), payload))
    return Chain(location=chain[0], links=tuple(links), raw_base=raw_base)


def _check_length(link: TensorLocation) -> None:
    """Refuse a recorded payload length no payload of the tensor can have, before reading it."""
    if not 0 < link.length <= most_payload_bytes(link.nbytes):
        raise IntegrityError(f"{subject(link)}: a {link.length}-byte payload cannot hold {link.nbytes} bytes")


def _checked_head(link: TensorLocation, head: bytearray) -> PayloadHead:
    """The header of ``link``'s payload (``head``: the payload, or its header alone), checked
    against the tensor and against what the store records of the payload."""
    parsed = parse_head(head, nbytes=link.nbytes, width=itemsize(link.dtype), subject=subject(link))
    if parsed.base != link.base or parsed.size != link.length:
        raise IntegrityError(f"{subject(link)}: its payload does not match what the store records of it")
    return parsed


def decode_into(read: ReadInto, chain: Chain, out: memoryview, *, blocks: range | None = None) -> None:
    """Decode ``chain``'s tensor into ``out`` (its raw length), or only ``blocks`` of it.

    A raw base at the bottom is read into ``out`` first (the part ``blocks`` covers).
    """
    view = memoryview(out).cast("B")
    if chain.raw_base is not None:
        head = chain.links[0][0]
        if blocks is None:
            read(chain.raw_base.shard_id, chain.raw_base.offset, view)
        elif len(blocks):
            begin, end = head.block(blocks[0])[0], head.block(blocks[-1])[1]
            read(chain.raw_base.shard_id, chain.raw_base.offset + begin, view[begin:end])
    decode_chain(chain.links, view, blocks=blocks, subject=subject(chain.location))


def _read_head(read: ReadInto, link: TensorLocation) -> PayloadHead:
    """The checked header of ``link``'s payload, read alone: its fixed part, then its frame table."""
    _check_length(link)
    fixed = bytearray(min(link.length, head_bytes(0)))
    read(link.shard_id, link.offset, memoryview(fixed))
    # Checked before it is read: a count the payload has no room for is no reason to allocate.
    length = min(link.length, head_bytes(min(frame_count(fixed), link.length // 4)))
    head = bytearray(length)
    read(link.shard_id, link.offset, memoryview(head))
    return _checked_head(link, head)


def iter_decoded(
    read: ReadInto, locations: Mapping[str, TensorLocation], digest: str, piece_bytes: int
) -> Iterator[bytes]:
    """The raw bytes of the located tensor ``digest``, stored encoded, in pieces of at most
    ``piece_bytes``, decoding a block at a time: only the payloads' headers and one block (of at
    most :data:`MAX_STREAMED_BLOCK`) are held at once, however large the tensor.

    Raises:
        IntegrityError: a payload is corrupt, or (after the last piece) the bytes do not hash to
            ``digest``: whoever passed the pieces on must then abandon what it sent.
    """
    chain = chain_of(locations, digest)
    encoded = [link for link in chain if link.encoded]
    raw_base = chain[len(encoded)] if len(encoded) < len(chain) else None
    heads = [_read_head(read, link) for link in encoded]
    check_chain(heads, subject=subject(chain[0]))
    if heads[0].block_bytes > MAX_STREAMED_BLOCK:
        raise IntegrityError(f"{subject(chain[0])}: blocks of {heads[0].block_bytes} bytes are too large to stream")
    hasher = TensorHasher(chain[0].dtype, chain[0].shape, parallel=False)
    block = memoryview(bytearray(heads[0].block_bytes))
    for index in range(len(heads[0].frames)):
        begin, end = heads[0].block(index)
        out = block[: end - begin]
        if raw_base is not None:
            read(raw_base.shard_id, raw_base.offset + begin, out)
        frames = []
        for link, head in zip(encoded, heads, strict=True):
            start, stop = head.frames[index]
            if stop - start > most_payload_bytes(end - begin):
                raise IntegrityError(f"{subject(link)}: block {index}'s frame of {stop - start} bytes is too long")
            frame = bytearray(stop - start)
            read(link.shard_id, link.offset + start, memoryview(frame))
            frames.append((head, frame))
        decode_block_frames(frames, index, out, subject=subject(chain[0]))
        hasher.update(out)
        for start in range(0, len(out), piece_bytes):
            yield bytes(out[start : start + piece_bytes])
    check_digest(chain[0], hasher.hexdigest())


def check_digest(location: TensorLocation, actual: str) -> None:
    """Refuse bytes of ``location``'s tensor that hashed to ``actual``, not to its digest."""
    if actual != location.digest:
        raise IntegrityError(f"{subject(location)} reads back as {actual[:16]}…; run `ckptstore verify`")


def read_raw(
    read: ReadInto, locations: Mapping[str, TensorLocation], digest: str, into: bytearray | None = None
) -> bytearray:
    """The raw bytes of the located tensor ``digest``, decoded if stored encoded, *not* checked
    against its digest (re-encoding bytes needs no check: whatever they are, every load checks
    what decoding them gives); read into ``into`` when given (its length must be the tensor's).

    Raises:
        IntegrityError: a payload is corrupt or does not fit its tensor.
    """
    location = locations[digest]
    data = bytearray(location.nbytes) if into is None else into
    if len(data) != location.nbytes:
        raise ValueError(f"{len(data)} bytes cannot hold a tensor of {location.nbytes}")
    if location.encoded:
        decode_into(read, fetch_chain(read, locations, digest), memoryview(data))
    else:
        read(location.shard_id, location.offset, memoryview(data))
    return data


def read_tensor(read: ReadInto, locations: Mapping[str, TensorLocation], digest: str) -> bytearray:
    """The raw bytes of the located tensor ``digest``, decoded if stored encoded, checked against its digest.

    Raises:
        IntegrityError: the bytes read or decoded do not hash to the digest, or a payload is corrupt.
    """
    location = locations[digest]
    data = read_raw(read, locations, digest)
    check_digest(location, tensor_digest(location.dtype, location.shape, data))
    return data


__all__ = [
    "MAX_CHAIN",
    "Chain",
    "ReadInto",
    "chain_of",
    "check_digest",
    "decode_into",
    "fetch_chain",
    "iter_decoded",
    "most_payload_bytes",
    "read_raw",
    "read_tensor",
    "subject",
]
