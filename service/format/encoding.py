"""Encoded tensors: byte-grouped zstd, and deltas against a base tensor (format v2).

A tensor stored *encoded* is the payload below instead of its raw bytes; its digest is still
the digest of the raw bytes (§1 of docs/FORMAT.md), so deduplication, ``verify`` and every
load-side check stay as they are, and decoding is checked against it.

Payload (``ckptstore.encoded/1``), little-endian:

```
magic "CKE1" | u8 kind (1 = grouped, 2 = xor delta, 3 = difference delta) | u8 group width | 2 zero bytes
u32 block bytes | u64 raw bytes | 32 bytes base digest (zeros unless a delta)
u32 block count | u32 frame length × block count | the frames, back to back
```

The raw bytes (for a delta: what it takes to get them from the base's raw bytes, below) are cut
into blocks of ``block bytes`` (the last shorter). Each block is *byte-grouped*, with the first
byte of every element, then the second, … (a bfloat16 block becomes its low bytes, then its high
bytes: the sign and exponent, which repeat a lot, end up together), and compressed as one zstd
frame.
Blocks decode independently, so a large tensor decodes on every core and a delta chain
decodes a block at a time.

A delta is either the XOR of the two tensors' bytes (kind 2, read but no longer written) or, per
element taken as a little-endian unsigned integer of the group width, the difference
``tensor - base`` modulo 2**(8 × width), zigzag-coded so that small steps either way are small
numbers (kind 3): a weight a few AdamW steps on moves a few units in its last place, and its
difference is then a few low bits where the XOR of two neighbouring numbers is often many
(bfloat16 weight deltas took 0.30x their raw bytes instead of 0.34x).

Nothing here trusts a payload: the header's fields, the frame table and every frame's
decompressed size are checked against what the caller knows (the tensor's byte length) before
a byte is written, and a frame never expands past its block.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

import zstandard

from ckptstore.service.errors import IntegrityError

Encoding = Literal["raw", "grouped-zstd", "xor-grouped-zstd", "diff-grouped-zstd"]
#: Encodings a tensor may be stored in; "raw" is a plain safetensors entry.
ENCODINGS: tuple[Encoding, ...] = ("raw", "grouped-zstd", "xor-grouped-zstd", "diff-grouped-zstd")
MAGIC = b"CKE1"
_KINDS: dict[Encoding, int] = {"grouped-zstd": 1, "xor-grouped-zstd": 2, "diff-grouped-zstd": 3}
#: How a payload's decoded elements meet what ``out`` holds: written over it, XORed into it, or
#: (zigzag-decoded) added to it.
Combine = Literal["write", "xor", "diff"]
_COMBINE: dict[Encoding, Combine] = {"grouped-zstd": "write", "xor-grouped-zstd": "xor", "diff-grouped-zstd": "diff"}
#: The encoding of each kind of delta :func:`encode` writes.
_DELTA_ENCODING: dict[str, Encoding] = {"diff": "diff-grouped-zstd", "xor": "xor-grouped-zstd"}
#: Encodings that decode from a base tensor.
DELTAS: frozenset[str] = frozenset(_DELTA_ENCODING.values())
_ENCODING_OF_KIND = {kind: encoding for encoding, kind in _KINDS.items()}
_HEAD = struct.Struct("<4sBB2xIQ32sI")
#: Raw bytes per block: small enough to stay in a core's cache while it is ungrouped, large
#: enough that a gigabyte is a thousand calls. A multiple of every element width.
BLOCK_BYTES = 1 << 20
#: zstd level: 1 compresses bfloat16 weights to about 0.67x; higher levels gain nothing on
#: grouped bytes, at half the speed.
LEVEL = 1
#: zstd's match finder keeps a table of 2**HASH_LOG entries. A grouped exponent plane repeats a
#: few byte values, so a large table finds many short matches that cost more to code (and to
#: decode) than the entropy-coded literals they replace: 2**8 entries stored bfloat16 weights in
#: 0.670x instead of 0.684x, compressed 2.6x and decompressed 2.8x faster (fp32: 0.835x against
#: 0.842x, 2x and 1.4x); XOR deltas kept their size and ran 1.4x faster both ways.
HASH_LOG = 8
_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}

if TYPE_CHECKING:
    import numpy as np


def _numpy() -> Any:
    """numpy, imported on first use: commands that never touch an encoded tensor (``serve``,
    ``db``, ``ls``) start without it."""
    import numpy

    return numpy


@dataclass(frozen=True)
class PayloadHead:
    """The parsed header of a payload: its encoding, group width, blocks and where each frame is."""

    encoding: Encoding
    group: int
    block_bytes: int
    nbytes: int
    base: str | None
    frames: tuple[tuple[int, int], ...]  # (start, end) of each block's frame within the payload

    @property
    def size(self) -> int:
        """The payload's length in bytes."""
        return self.frames[-1][1] if self.frames else _HEAD.size + 4 * len(self.frames)

    def block(self, index: int) -> tuple[int, int]:
        """The raw byte range ``(begin, end)`` block ``index`` decodes to."""
        begin = index * self.block_bytes
        return begin, min(begin + self.block_bytes, self.nbytes)


def head_bytes(count: int) -> int:
    """Length of a payload's header for ``count`` blocks (what to read before its frames)."""
    return _HEAD.size + 4 * count


def block_count(nbytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many blocks ``nbytes`` raw bytes are cut into."""
    return -(-nbytes // block_bytes)


def _group_into(block: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """``block``'s bytes byte-grouped, written into ``out`` (as long): each element's first byte,
    then each one's second, …; single bytes are already grouped (``block`` is returned)."""
    np = _numpy()
    if width == 1:
        return block
    count = block.size // width
    planes = out.reshape(width, count)
    words = block.view(np.dtype(_UINT[width]))
    # Each plane is the elements shifted and narrowed: at memory speed, where a transposing copy
    # moves a byte at a time (bfloat16: 12 GB/s a core against 3).
    planes[0] = words  # narrowing keeps the low byte
    if width == 2:
        np.right_shift(words, 8, out=planes[1], casting="unsafe")
    else:
        shifted = np.empty_like(words)
        for byte in range(1, width):
            np.right_shift(words, 8 * byte, out=shifted)
            planes[byte] = shifted
    return out


def _zigzag_difference_into(block: np.ndarray, base: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Write into ``out`` the bytes of ``block - base`` per element (unsigned, wrapping),
    zigzag-coded: 0, -1, 1, -2, … become 0, 1, 2, 3, … so a small step either way leaves the high
    bytes zero; returns ``out``."""
    np = _numpy()
    unsigned = np.dtype(_UINT[width])
    difference = out.view(unsigned)
    np.subtract(block.view(unsigned), base.view(unsigned), out=difference)
    sign = np.right_shift(difference.view(f"i{width}"), 8 * width - 1).view(unsigned)  # all ones if negative
    np.left_shift(difference, 1, out=difference)
    np.bitwise_xor(difference, sign, out=difference)
    return out


def _add_zigzag(out: np.ndarray, coded: np.ndarray, width: int) -> None:
    """Add to ``out``'s elements the differences ``coded`` holds zigzag-coded (see :func:`_zigzag_difference_into`)."""
    np = _numpy()
    unsigned = np.dtype(_UINT[width])
    words = coded.view(unsigned)
    sign = np.bitwise_and(words, 1)
    np.negative(sign, out=sign)  # all ones where the difference is negative
    np.right_shift(words, 1, out=words)
    np.bitwise_xor(words, sign, out=words)
    np.add(out.view(unsigned), words, out=out.view(unsigned))


def _ungroup_into(grouped: np.ndarray, width: int, out: np.ndarray, *, combine: Combine) -> None:
    """Write the elements whose byte groups ``grouped`` holds into ``out``, or, for a delta,
    XOR them into it or add their zigzag-coded differences to it (``combine``)."""
    np = _numpy()
    if width == 1 and combine != "diff":
        if combine == "xor":
            np.bitwise_xor(out, grouped, out=out)
        else:
            out[:] = grouped
        return
    if width == 1:
        _add_zigzag(out, grouped.copy(), 1)
        return
    planes = grouped.reshape(width, grouped.size // width)
    target = out if combine == "write" else np.empty_like(out)
    if width == 2:
        # bfloat16 and float16: shifting the high plane into 16-bit integers and or-ing in the
        # low one runs at memory speed (5 GB/s a core), twice np.stack's.
        wide = target.view(np.uint16)
        np.left_shift(planes[1], 8, out=wide, dtype=np.uint16)
        np.bitwise_or(wide, planes[0], out=wide, casting="unsafe")
    elif width == 4:
        # float32: the byte pairs into 16-bit integers as above, then the pairs into 32-bit ones:
        # 5.6 GB/s a core, against 3.6 for np.stack.
        pairs = np.empty((2, planes.shape[1]), dtype=np.uint16)
        for pair, (low, high) in zip(pairs, ((0, 1), (2, 3)), strict=True):
            np.left_shift(planes[high], 8, out=pair, dtype=np.uint16)
            np.bitwise_or(pair, planes[low], out=pair, casting="unsafe")
        wide = target.view(np.uint32)
        np.left_shift(pairs[1], 16, out=wide, dtype=np.uint32)
        np.bitwise_or(wide, pairs[0], out=wide, casting="unsafe")
    else:
        # A strided transposing write was ten times slower than stacking the planes.
        np.stack(tuple(planes), axis=1, out=target.reshape(-1, width))
    if combine == "xor":
        np.bitwise_xor(out, target, out=out)
    elif combine == "diff":
        _add_zigzag(out, target, width)


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two scratch arrays of at least ``size`` bytes, cut to it: a block's grouped
    bytes and its difference from a base. Kept between calls: a collection encodes gigabytes a
    block at a time, and fresh arrays cost it a page fault every 4 KiB."""
    np = _numpy()
    found = getattr(_ENCODING_SCRATCH, "arrays", None)
    if found is None or found[0].size < size:
        found = _ENCODING_SCRATCH.arrays = (np.empty(size, dtype=np.uint8), np.empty(size, dtype=np.uint8))
    return found[0][:size], found[1][:size]


_ENCODING_SCRATCH = threading.local()


class EncodeOptions(TypedDict, total=False):
    """What :func:`encode` passes on to :func:`encode_parts` besides the data and its width."""

    base: memoryview | bytes | bytearray | None
    base_digest: str | None
    delta: Literal["diff", "xor"]
    level: int
    block_bytes: int


def encode_parts(
    data: memoryview | bytes | bytearray,
    width: int,
    *,
    base: memoryview | bytes | bytearray | None = None,
    base_digest: str | None = None,
    delta: Literal["diff", "xor"] = "diff",
    level: int = LEVEL,
    block_bytes: int = BLOCK_BYTES,
) -> list[bytes]:
    """The payload of ``data`` (a tensor's raw bytes, elements ``width`` bytes wide): grouped and
    compressed, or, given ``base`` (raw bytes of the same length) and its digest, the two's
    difference (``delta="diff"``; ``"xor"`` writes the older XOR delta) grouped and compressed: its
    header and frame table, then each frame, as :func:`encode` joins them (a collection writes the
    parts as they are: joining copies, into fresh memory, as much as it stores)."""
    np = _numpy()
    raw = np.frombuffer(data, dtype=np.uint8)
    if width not in _UINT or raw.size % width:
        raise ValueError(f"{raw.size} bytes are not a whole number of {width}-byte elements")
    if base is not None:
        other = np.frombuffer(base, dtype=np.uint8)
        if other.size != raw.size or base_digest is None:
            raise ValueError("a delta needs a base of the same length and its digest")
    if block_bytes % 8 or block_bytes <= 0:
        raise ValueError(f"block_bytes {block_bytes} must be a positive multiple of 8")
    parameters = zstandard.ZstdCompressionParameters.from_level(
        level, hash_log=HASH_LOG, write_content_size=True, write_checksum=False
    )
    compressor = zstandard.ZstdCompressor(compression_params=parameters)
    frames = []
    grouped, difference = _scratch(min(block_bytes, raw.size))
    for begin in range(0, raw.size, block_bytes):
        block = raw[begin : begin + block_bytes]
        size = block.size
        if base is not None and delta == "xor":
            block = np.bitwise_xor(block, other[begin : begin + size], out=difference[:size])
        elif base is not None:
            block = _zigzag_difference_into(block, other[begin : begin + size], width, difference[:size])
        frames.append(compressor.compress(_group_into(block, width, grouped[:size]).data))
    kind = _KINDS["grouped-zstd" if base is None else _DELTA_ENCODING[delta]]
    digest = bytes.fromhex(base_digest) if base is not None and base_digest is not None else bytes(32)
    head = _HEAD.pack(MAGIC, kind, width, block_bytes, raw.size, digest, len(frames))
    return [head + struct.pack(f"<{len(frames)}I", *map(len, frames)), *frames]


def encode(data: memoryview | bytes | bytearray, width: int, **options: Unpack[EncodeOptions]) -> bytes:
    """The payload :func:`encode_parts` makes of ``data``, joined into one bytes object."""
    return b"".join(encode_parts(data, width, **options))


def parse_head(payload: memoryview | bytes | bytearray, *, nbytes: int, width: int, subject: str) -> PayloadHead:
    """Check a payload's header and frame table against the tensor it should decode to.

    ``payload`` may be just the header (:func:`head_bytes`) or the whole payload; frames beyond
    its end are the caller's to read.

    Raises:
        IntegrityError: naming ``subject``, when a field is not what ``nbytes`` and ``width``
            (the tensor's byte length and element width) require.
    """
    view = memoryview(payload)
    if view.nbytes < _HEAD.size:
        raise IntegrityError(f"{subject}: encoded payload of {view.nbytes} bytes is shorter than its header")
    magic, kind, group, block_bytes, raw_bytes, base, count = _HEAD.unpack_from(view)
    encoding = _ENCODING_OF_KIND.get(kind)
    if magic != MAGIC or encoding is None:
        raise IntegrityError(f"{subject}: not an encoded payload (magic {bytes(magic)!r}, kind {kind})")
    if group != width or raw_bytes != nbytes:
        raise IntegrityError(
            f"{subject}: payload describes {raw_bytes} bytes in groups of {group}, "
            f"but the tensor has {nbytes} bytes of {width}-byte elements"
        )
    if block_bytes <= 0 or block_bytes % 8 or count != block_count(nbytes, block_bytes):
        raise IntegrityError(f"{subject}: payload has {count} blocks of {block_bytes} bytes for {nbytes} bytes")
    if view.nbytes < head_bytes(count):
        raise IntegrityError(f"{subject}: payload ends inside its frame table")
    lengths = struct.unpack_from(f"<{count}I", view, _HEAD.size)
    frames = []
    position = head_bytes(count)
    for length in lengths:
        frames.append((position, position + length))
        position += length
    has_base = encoding in DELTAS
    if has_base == (base == bytes(32)):
        raise IntegrityError(f"{subject}: payload's base digest does not fit its encoding {encoding}")
    return PayloadHead(
        encoding=encoding,
        group=group,
        block_bytes=block_bytes,
        nbytes=nbytes,
        base=base.hex() if has_base else None,
        frames=tuple(frames),
    )


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: one may not be used by two threads at once."""
    found: zstandard.ZstdDecompressor | None = getattr(_LOCAL, "decompressor", None)
    if found is None:
        found = _LOCAL.decompressor = zstandard.ZstdDecompressor()
    return found


def decode_block(
    head: PayloadHead, payload: memoryview | bytes | bytearray, index: int, out: memoryview, *, subject: str
) -> None:
    """Decode block ``index`` of a payload into ``out`` (exactly the block's raw length); a
    delta's block applies to what ``out`` holds, its base's bytes.

    Raises:
        IntegrityError: naming ``subject``, when the frame is cut short, corrupt or decodes to
            any other length than the block's.
    """
    np = _numpy()
    target = np.frombuffer(out, dtype=np.uint8)
    if target.size != head.block(index)[1] - head.block(index)[0]:
        raise ValueError(f"block {index} needs {head.block(index)[1] - head.block(index)[0]} bytes, not {target.size}")
    _ungroup_into(_frame(head, payload, index, subject), head.group, target, combine=_COMBINE[head.encoding])


def frame_count(fixed: memoryview | bytes | bytearray) -> int:
    """The block count a payload's first :func:`head_bytes` ``(0)`` bytes declare (0 if they are
    fewer): how much of its header to read next, once checked against the payload's length."""
    return int(_HEAD.unpack_from(fixed)[-1]) if len(fixed) >= _HEAD.size else 0


def _frame(head: PayloadHead, payload: memoryview | bytes | bytearray, index: int, subject: str) -> np.ndarray:
    """Block ``index`` of a payload decompressed, still byte-grouped, once checked (see :func:`decode_block`)."""
    return _inflate(head, _frame_bytes(head, payload, index, subject), index, subject)


def _frame_bytes(head: PayloadHead, payload: memoryview | bytes | bytearray, index: int, subject: str) -> memoryview:
    """The bytes of block ``index``'s frame within a whole payload."""
    start, stop = head.frames[index]
    view = memoryview(payload)
    if stop > view.nbytes:
        raise IntegrityError(f"{subject}: payload ends inside block {index}")
    return view[start:stop]


def _inflate(head: PayloadHead, frame: memoryview | bytes | bytearray, index: int, subject: str) -> np.ndarray:
    """Block ``index``'s frame (its bytes alone) decompressed, still byte-grouped, once checked."""
    begin, end = head.block(index)
    view = memoryview(frame)
    try:
        params = zstandard.get_frame_parameters(view)
        if params.content_size != end - begin:
            raise IntegrityError(f"{subject}: block {index} claims {params.content_size} bytes, not {end - begin}")
        # A frame fills its slot of the payload exactly: bytes after it (another frame, or
        # anything else) mean the frame table does not describe the payload.
        grouped = _decompressor().decompress(view, max_output_size=end - begin, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{subject}: block {index} does not decompress: {exc}") from exc
    if len(grouped) != end - begin:
        raise IntegrityError(f"{subject}: block {index} decoded to {len(grouped)} bytes, not {end - begin}")
    return _numpy().frombuffer(grouped, dtype=_numpy().uint8)


def decode_chain(
    chain: Sequence[tuple[PayloadHead, memoryview | bytes | bytearray]],
    out: memoryview,
    *,
    blocks: range | None = None,
    subject: str,
) -> None:
    """Decode a tensor stored as a chain of payloads into ``out`` (its raw bytes).

    ``chain`` lists the tensor's own payload first, then its base's, down to one without a
    base (a delta's base may be a delta). Every block of ``blocks`` (default all) is decoded
    from the last payload and the deltas above it applied in turn. A chain of raw tensors is
    the caller's: a raw base's bytes belong in ``out`` first, and its payload left out.

    Raises:
        IntegrityError: a payload is corrupt, or the chain's payloads do not fit together.
    """
    check_chain([head for head, _ in chain], subject=subject)
    first = chain[0][0]
    view = memoryview(out).cast("B")
    for index in blocks if blocks is not None else range(len(first.frames)):
        begin, end = first.block(index)
        frames = [(head, _frame_bytes(head, payload, index, subject)) for head, payload in chain]
        decode_block_frames(frames, index, view[begin:end], subject=subject)


def check_chain(heads: Sequence[PayloadHead], *, subject: str) -> None:
    """Check that payload headers listed as a tensor's own, then its base's, … fit together:
    each above the last a delta, all of one block size and raw length.

    Raises:
        IntegrityError: naming ``subject``, when they do not.
    """
    if not heads:
        raise ValueError("an empty chain decodes to nothing")
    for head, below in zip(heads, heads[1:], strict=False):
        if head.base is None or head.block_bytes != below.block_bytes or head.nbytes != below.nbytes:
            raise IntegrityError(f"{subject}: its delta chain does not fit together")


def decode_block_frames(
    frames: Sequence[tuple[PayloadHead, memoryview | bytes | bytearray]], index: int, out: memoryview, *, subject: str
) -> None:
    """Decode block ``index`` of a chain (checked by :func:`check_chain`) from each payload's
    frame of that block alone, listed as in :func:`decode_chain`, into ``out`` (the block's raw
    bytes; when the last payload is a delta, its raw base's block must be there already).

    Raises:
        IntegrityError: naming ``subject``, when a frame is corrupt or does not fill its block.
    """
    np = _numpy()
    first = frames[0][0]
    target = np.frombuffer(out, dtype=np.uint8)
    bottom_is_delta = frames[-1][0].base is not None
    # Grouping permutes bytes the same way in every payload of one width, so the XORs of a chain
    # apply to grouped blocks and the block is ungrouped once, not once per link.
    if len({head.group for head, _ in frames}) == 1 and all(_COMBINE[head.encoding] != "diff" for head, _ in frames):
        grouped = None
        for head, frame in reversed(frames):
            inflated = _inflate(head, frame, index, subject)
            grouped = inflated if grouped is None else np.bitwise_xor(grouped, inflated)
        assert grouped is not None
        _ungroup_into(grouped, first.group, target, combine="xor" if bottom_is_delta else "write")
        return
    for head, frame in reversed(frames):
        _ungroup_into(_inflate(head, frame, index, subject), head.group, target, combine=_COMBINE[head.encoding])


__all__ = [
    "BLOCK_BYTES",
    "DELTAS",
    "ENCODINGS",
    "EncodeOptions",
    "LEVEL",
    "Encoding",
    "PayloadHead",
    "block_count",
    "check_chain",
    "decode_block",
    "decode_block_frames",
    "decode_chain",
    "encode",
    "encode_parts",
    "frame_count",
    "head_bytes",
    "parse_head",
]
