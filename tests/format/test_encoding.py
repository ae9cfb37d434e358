"""The encoded payload codec (format v2): round trips, golden bytes and a hand-built hostile corpus.

Payloads and the zstd frames inside them are spelled out with ``struct.pack``: a zstd frame is
its magic, a frame header and raw or RLE blocks (RFC 8878 §3.1), so each hostile case differs
from a valid payload in exactly one way and cannot pass by some other rule.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.errors import IntegrityError
from ckptstore.service.format.dtypes import DTYPES, itemsize
from ckptstore.service.format.encoding import (
    BLOCK_BYTES,
    MAGIC,
    PayloadHead,
    block_count,
    decode_block,
    decode_chain,
    encode,
    encode_parts,
    head_bytes,
    parse_head,
)

SUBJECT = "tensor under test"
HEAD = struct.Struct("<4sBB2xIQ32sI")
GROUPED, DELTA, DIFFERENCE = 1, 2, 3
DELTA_KINDS = ("diff", "xor")
BASE_DIGEST = "ab" * 32
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GUARD = 16


# -- hand-built zstd frames (RFC 8878) -------------------------------------------------------


def zblock(kind: int, size: int, body: bytes, *, last: bool = True) -> bytes:
    """A zstd block: a 3-byte header (last flag, type 0 raw / 1 RLE, size), then its body."""
    return struct.pack("<I", size << 3 | kind << 1 | last)[:3] + body


def zraw(data: bytes, *, last: bool = True) -> bytes:
    return zblock(0, len(data), data, last=last)


def zrle(byte: int, count: int, *, last: bool = True) -> bytes:
    """``count`` copies of ``byte`` from one byte of input (at most 128 KiB per block)."""
    return zblock(1, count, bytes([byte]), last=last)


def zframe(content_size: int | None, *blocks: bytes) -> bytes:
    """A zstd frame with a 128 KiB window, a 4-byte content size (or none) and ``blocks``."""
    magic = struct.pack("<I", 0xFD2FB528)
    if content_size is None:
        return magic + bytes([0x00, 0x38]) + b"".join(blocks)
    return magic + bytes([0x80, 0x38]) + struct.pack("<I", content_size) + b"".join(blocks)


def payload(
    frames: list[bytes],
    *,
    magic: bytes = MAGIC,
    kind: int = GROUPED,
    width: int = 2,
    block_bytes: int = 8,
    nbytes: int = 16,
    base: bytes = bytes(32),
    count: int | None = None,
    lengths: list[int] | None = None,
) -> bytes:
    """A payload spelled out field by field; ``count`` and ``lengths`` default to the frames'."""
    lengths = [len(f) for f in frames] if lengths is None else lengths
    count = len(lengths) if count is None else count
    head = HEAD.pack(magic, kind, width, block_bytes, nbytes, base, count)
    return head + struct.pack(f"<{len(lengths)}I", *lengths) + b"".join(frames)


def guarded(nbytes: int, fill: int = 0xA5) -> tuple[bytearray, memoryview]:
    """A buffer of ``nbytes`` between two guard bands, and a view of its middle."""
    buffer = bytearray([fill]) * (nbytes + 2 * GUARD)
    return buffer, memoryview(buffer)[GUARD : GUARD + nbytes]


def decode(data: bytes, *, nbytes: int, width: int, base: bytes | None = None) -> bytes:
    """Parse and decode a one-link chain (``base`` is a raw base's bytes, for a delta)."""
    head = parse_head(data, nbytes=nbytes, width=width, subject=SUBJECT)
    buffer, view = guarded(nbytes)
    if base is not None:
        view[:] = base
    decode_chain([(head, data)], view, subject=SUBJECT)
    assert buffer[:GUARD] == buffer[-GUARD:] == bytes([0xA5]) * GUARD
    return bytes(view)


def grouped_by_hand(data: bytes, width: int) -> bytes:
    """Byte ``k`` of every element, for k = 0 .. width-1, spelled out without numpy."""
    return bytes(data[i + k] for k in range(width) for i in range(0, len(data), width))


# -- data ------------------------------------------------------------------------------------

WIDTHS = sorted({itemsize(name) for name in DTYPES})
NUMERIC = {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}


def make(kind: str, nbytes: int, width: int, seed: int) -> bytes:
    """``nbytes`` of data of one shape: random, zeros, zero runs in random bytes, or numbers."""
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return bytes(nbytes)
    if kind == "floats":
        values = rng.standard_normal(nbytes // width) * 10
        return values.astype(NUMERIC[width]).tobytes()
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "zero-runs":
        for _ in range(rng.integers(1, 6)):
            begin = int(rng.integers(0, nbytes))
            data[begin : begin + int(rng.integers(1, 300))] = 0
    return data.tobytes()


def perturb(data: bytes, width: int, seed: int) -> bytes:
    """``data`` with a few elements changed: the next version of a tensor."""
    rng = np.random.default_rng(seed)
    changed = bytearray(data)
    for _ in range(int(rng.integers(0, 5))):
        begin = int(rng.integers(0, len(data) // width)) * width
        changed[begin : begin + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
    return bytes(changed)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[str, int, int, int, str, int]:
    """(dtype, width, block bytes, byte length, data kind, seed), lengths at the block edges included."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    width = itemsize(dtype)
    block_bytes = draw(st.sampled_from([8, 64, 4096]))
    per_block = block_bytes // width
    edges = [1, per_block, per_block + 1, 2 * per_block - 1, 3 * per_block]
    count = draw(st.one_of(st.sampled_from(edges), st.integers(1, 3 * per_block + 5)))
    kind = draw(st.sampled_from(["random", "zeros", "zero-runs", "floats"]))
    return dtype, width, block_bytes, count * width, kind, draw(st.integers(0, 2**32 - 1))


# -- round trips -----------------------------------------------------------------------------


@FAST
@given(tensors())
def test_a_keyframe_decodes_to_its_bytes(tensor: tuple[str, int, int, int, str, int]) -> None:
    _, width, block_bytes, nbytes, kind, seed = tensor
    data = make(kind, nbytes, width, seed)
    encoded = encode(data, width, block_bytes=block_bytes)
    head = parse_head(encoded, nbytes=nbytes, width=width, subject=SUBJECT)
    assert (head.encoding, head.group, head.block_bytes, head.base) == ("grouped-zstd", width, block_bytes, None)
    assert len(head.frames) == block_count(nbytes, block_bytes) and head.size == len(encoded)
    assert decode(encoded, nbytes=nbytes, width=width) == data


def stepped(data: bytes, width: int, seed: int, most: int) -> bytes:
    """``data`` with every element, read as an unsigned integer, moved by up to ``most`` either way
    (wrapping at both ends): the next version of a tensor every element of which trained on."""
    unsigned = np.dtype(f"u{width}")
    values = np.frombuffer(data, dtype=unsigned)
    steps = np.random.default_rng(seed).integers(-most, most + 1, values.size).astype(unsigned)  # -1 wraps to all ones
    return (values + steps).tobytes()


@FAST
@given(tensors(), st.integers(0, 2**32 - 1), st.sampled_from(DELTA_KINDS), st.sampled_from([0, 1, 3, 1000]))
def test_a_delta_decodes_against_its_raw_base(
    tensor: tuple[str, int, int, int, str, int], other: int, delta: str, most: int
) -> None:
    """Either kind of delta, for a few elements changed or all moved (zeros moved down wrap around)."""
    _, width, block_bytes, nbytes, kind, seed = tensor
    base = make(kind, nbytes, width, seed)
    data = perturb(base, width, other) if most == 0 else stepped(base, width, other, most)
    encoded = encode(data, width, base=base, base_digest=BASE_DIGEST, delta=delta, block_bytes=block_bytes)  # type: ignore[arg-type]
    head = parse_head(encoded, nbytes=nbytes, width=width, subject=SUBJECT)
    assert (head.encoding, head.base) == (f"{delta}-grouped-zstd", BASE_DIGEST)
    assert decode(encoded, nbytes=nbytes, width=width, base=base) == data


def zigzag_by_hand(data: bytes, base: bytes, width: int) -> bytes:
    """Each element's difference from its base's, wrapping, zigzag-coded, with Python integers."""
    bits, out = 8 * width, bytearray()
    for i in range(0, len(data), width):
        element, under = (int.from_bytes(b[i : i + width], "little") for b in (data, base))
        step = (element - under) % (1 << bits)
        signed = step - (1 << bits) if step >> (bits - 1) else step
        coded = ((signed << 1) ^ (signed >> (bits - 1))) & ((1 << bits) - 1)
        out += coded.to_bytes(width, "little")
    return bytes(out)


@FAST
@given(tensors(), st.booleans(), st.integers(0, 2**32 - 1))
def test_each_frame_holds_its_block_grouped_and_the_parts_join_to_the_payload(
    tensor: tuple[str, int, int, int, str, int], as_delta: bool, other: int
) -> None:
    """Grouping (and the difference) checked against Python, block by block, for every width:
    the scratch arrays an encoding reuses never leak one block's bytes into the next."""
    _, width, block_bytes, nbytes, kind, seed = tensor
    data = make(kind, nbytes, width, seed)
    base = make("random", nbytes, width, other) if as_delta else None
    digest = BASE_DIGEST if as_delta else None
    parts = encode_parts(data, width, base=base, base_digest=digest, block_bytes=block_bytes)
    assert b"".join(parts) == encode(data, width, base=base, base_digest=digest, block_bytes=block_bytes)
    assert len(parts) == 1 + block_count(nbytes, block_bytes) and len(parts[0]) == head_bytes(len(parts) - 1)
    elements = data if base is None else zigzag_by_hand(data, base, width)
    for index, frame in enumerate(parts[1:]):
        block = elements[index * block_bytes : (index + 1) * block_bytes]
        assert zstandard.ZstdDecompressor().decompress(frame) == grouped_by_hand(block, width)


def test_threads_encoding_at_once_each_get_their_own_bytes() -> None:
    """Every thread has scratch arrays of its own: four encoding tensors of different sizes at
    once each get a payload that decodes to their tensor."""
    start, failures = threading.Barrier(4), []

    def encode_many(seed: int) -> None:
        start.wait()
        for round_ in range(12):
            width = WIDTHS[(seed + round_) % len(WIDTHS)]
            nbytes = width * (1 + (seed * 7919 + round_ * 104729) % 20000)
            data = make("floats", nbytes, width, seed * 100 + round_)
            if decode(encode(data, width, block_bytes=4096), nbytes=nbytes, width=width) != data:
                failures.append((seed, round_))

    threads = [threading.Thread(target=encode_many, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("most", [1, 3, 8])
def test_small_steps_take_fewer_bytes_as_differences_than_as_xor(width: int, most: int) -> None:
    """Weights each moved a few units in their last place: the zigzag difference is a few low
    bits, the XOR of two neighbouring numbers often many (a carry flips every bit it runs through)."""
    values = (np.random.default_rng(5).standard_normal(BLOCK_BYTES // 4) * 0.02).astype(np.float32)
    base = values.tobytes() if width == 4 else (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    data = stepped(base, width, 9, most)
    sizes = {delta: len(encode(data, width, base=base, base_digest=BASE_DIGEST, delta=delta)) for delta in DELTA_KINDS}  # type: ignore[arg-type]
    assert sizes["diff"] < 0.95 * sizes["xor"], sizes


@pytest.mark.parametrize("width", WIDTHS)
def test_every_width_round_trips_one_element_one_block_and_one_past(width: int) -> None:
    for nbytes in (width, 64, 64 + width, 64 * 3 - width):
        data = make("random", nbytes, width, nbytes)
        assert decode(encode(data, width, block_bytes=64), nbytes=nbytes, width=width) == data


def test_an_empty_tensor_is_a_header_alone() -> None:
    encoded = encode(b"", 4)
    assert encoded == HEAD.pack(MAGIC, GROUPED, 4, BLOCK_BYTES, 0, bytes(32), 0)
    head = parse_head(encoded, nbytes=0, width=4, subject=SUBJECT)
    assert head.frames == () and head.size == len(encoded) == head_bytes(0)
    assert decode(encoded, nbytes=0, width=4) == b""


def test_real_blocks_of_a_mebibyte() -> None:
    """The default block size: bfloat16-like weights over two and a half blocks, whole and by block."""
    values = (np.random.default_rng(7).standard_normal(BLOCK_BYTES * 5 // 4) * 0.02).astype(np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bfloat16 by truncation
    encoded = encode(data, 2)
    head = parse_head(encoded, nbytes=len(data), width=2, subject=SUBJECT)
    assert head.block_bytes == BLOCK_BYTES and len(head.frames) == 3
    assert len(encoded) < 0.8 * len(data)  # the exponent bytes group together and compress
    assert decode(encoded, nbytes=len(data), width=2) == data
    buffer, view = guarded(len(data), fill=0)
    decode_chain([(head, encoded)], view, blocks=range(2, 3), subject=SUBJECT)
    assert bytes(view[2 * BLOCK_BYTES :]) == data[2 * BLOCK_BYTES :]
    assert not any(buffer[: GUARD + 2 * BLOCK_BYTES])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors(), st.integers(1, 4), st.booleans(), st.integers(0, 2**32 - 1), st.data())
def test_chains_decode_whole_or_by_blocks(
    tensor: tuple[str, int, int, int, str, int], depth: int, raw_bottom: bool, seed: int, data: st.DataObject
) -> None:
    """Version 0 at the bottom (a keyframe, or raw bytes the caller puts in ``out``), each later
    version a delta against the one before; decoding only some blocks touches only those."""
    _, width, block_bytes, nbytes, kind, first = tensor
    versions = [make(kind, nbytes, width, first)]
    for step in range(depth if raw_bottom else depth - 1):
        versions.append(
            perturb(versions[-1], width, seed + step) if step % 2 else stepped(versions[-1], width, seed, 2)
        )
    links = [] if raw_bottom else [encode(versions[0], width, block_bytes=block_bytes)]
    for older, newer in zip(versions, versions[1:], strict=False):
        delta = data.draw(st.sampled_from(DELTA_KINDS), label="delta kind")  # a chain may mix the two
        links.append(encode(newer, width, base=older, base_digest=BASE_DIGEST, delta=delta, block_bytes=block_bytes))
    chain = [(parse_head(p, nbytes=nbytes, width=width, subject=SUBJECT), p) for p in reversed(links)]
    assert len(chain) == depth

    buffer, view = guarded(nbytes)
    if raw_bottom:
        view[:] = versions[0]
    decode_chain(chain, view, subject=SUBJECT)
    assert bytes(view) == versions[-1]

    count = block_count(nbytes, block_bytes)
    begin = data.draw(st.integers(0, count), label="first block")
    blocks = range(begin, data.draw(st.integers(begin, count), label="end block"))
    buffer, view = guarded(nbytes, fill=0x5A)
    low, high = (min(edge * block_bytes, nbytes) for edge in (blocks.start, blocks.stop))
    if raw_bottom:
        view[low:high] = versions[0][low:high]
    decode_chain(chain, view, blocks=blocks, subject=SUBJECT)
    expected = bytes([0x5A]) * (GUARD + low) + versions[-1][low:high] + bytes([0x5A]) * (nbytes - high + GUARD)
    assert bytes(buffer) == expected


@pytest.mark.parametrize("delta", DELTA_KINDS)
def test_widths_may_differ_along_a_chain(delta: str) -> None:
    """A delta applies to raw bytes: its grouping (and element width) is its own, whatever its base's was."""
    base = make("floats", 64, 4, 1)
    data = stepped(perturb(base, 4, 2), 4, 3, 2)
    keyframe = encode(base, 4, block_bytes=16)
    encoded = encode(data, 2, base=base, base_digest=BASE_DIGEST, delta=delta, block_bytes=16)  # type: ignore[arg-type]
    chain = [
        (parse_head(encoded, nbytes=64, width=2, subject=SUBJECT), encoded),
        (parse_head(keyframe, nbytes=64, width=4, subject=SUBJECT), keyframe),
    ]
    out = bytearray(64)
    decode_chain(chain, memoryview(out), subject=SUBJECT)
    assert out == data


def test_encoding_is_deterministic_and_checks_its_arguments() -> None:
    data = make("floats", 256, 4, 3)
    assert encode(data, 4, block_bytes=64) == encode(bytearray(data), 4, block_bytes=64)
    with pytest.raises(ValueError, match="same length"):
        encode(data, 4, base=data[:-4], base_digest=BASE_DIGEST)
    with pytest.raises(ValueError, match="its digest"):
        encode(data, 4, base=data)
    for block_bytes in (0, -8, 12):
        with pytest.raises(ValueError, match="positive multiple of 8"):
            encode(data, 4, block_bytes=block_bytes)
    with pytest.raises(ValueError, match="whole number of 4-byte elements"):
        encode(data[:-1], 4)
    with pytest.raises(ValueError, match="whole number of 3-byte elements"):
        encode(data[:3], 3)


# -- golden bytes ----------------------------------------------------------------------------

# Eight bfloat16 values, two blocks of four: 1.0 -2.0 0.5 3.0 | 0.0 -0.0 1.5 -1.0
BF16 = struct.pack("<8H", 0x3F80, 0xC000, 0x3F00, 0x4040, 0x0000, 0x8000, 0x3FC0, 0xBF80)
# Grouped by hand: each block's four low bytes, then its four high bytes.
GROUPED_BLOCKS = [bytes.fromhex("800000403fc03f40"), bytes.fromhex("0000c08000803fbf")]


def test_golden_grouping() -> None:
    assert grouped_by_hand(BF16[:8], 2) == GROUPED_BLOCKS[0]
    assert grouped_by_hand(BF16[8:], 2) == GROUPED_BLOCKS[1]


def split_frames(data: bytes, count: int) -> list[bytes]:
    """The frames a payload's frame table points to, found with ``struct`` alone."""
    lengths = struct.unpack_from(f"<{count}I", data, HEAD.size)
    frames, position = [], HEAD.size + 4 * count
    for length in lengths:
        frames.append(data[position : position + length])
        position += length
    assert position == len(data)
    return frames


def test_golden_keyframe_payload() -> None:
    data = encode(BF16, 2, block_bytes=8)
    # Everything but the zstd frames is fixed by the format: a 56-byte header (magic, kind 1,
    # width 2, two zero bytes, block bytes 8, raw bytes 16, no base digest, two blocks), then
    # the frame table.
    assert HEAD.size == head_bytes(0) == 56
    assert data[:56] == b"CKE1" + bytes([1, 2, 0, 0]) + struct.pack("<IQ", 8, 16) + bytes(32) + struct.pack("<I", 2)
    frames = split_frames(data, 2)
    assert data[56:64] == struct.pack("<2I", *map(len, frames))
    # The frames' compressed bytes are zstd's to choose and may change between library
    # versions, so they are checked by what they decode to and what their headers say.
    for frame, grouped in zip(frames, GROUPED_BLOCKS, strict=True):
        params = zstandard.get_frame_parameters(frame)
        assert params.content_size == 8 and not params.has_checksum
        assert zstandard.ZstdDecompressor().decompress(frame) == grouped


def test_golden_difference_payload() -> None:
    """Each element's difference from its base as a 16-bit integer, zigzag-coded: 0x8000 - 0x7FFF
    is 1, coded 2; 0xBF80 - 0xBF81 is -1, coded 1 (their XORs would be 0xFFFF and 0x0001)."""
    base = struct.pack("<8H", 0x3F80, 0xC000, 0x3F00, 0x4040, 0x0000, 0x7FFF, 0x3FC0, 0xBF81)
    data = encode(BF16, 2, base=base, base_digest=BASE_DIGEST, block_bytes=8)
    assert data[:56] == b"CKE1" + bytes([3, 2, 0, 0]) + struct.pack("<IQ", 8, 16) + b"\xab" * 32 + struct.pack("<I", 2)
    decompress = zstandard.ZstdDecompressor().decompress
    assert [decompress(frame) for frame in split_frames(data, 2)] == [bytes(8), bytes.fromhex("0002000100000000")]
    # Hand-built (raw zstd blocks), the same difference blocks decode onto the base.
    fixed = payload(
        [zframe(8, zraw(bytes(8))), zframe(8, zraw(bytes.fromhex("0002000100000000")))],
        kind=DIFFERENCE,
        base=b"\xab" * 32,
    )
    assert decode(fixed, nbytes=16, width=2, base=base) == BF16
    # The largest step either way: 0x0000 - 0xFFFF wraps to 1 (coded 2), 0xFFFF - 0x0000 to -1 (coded 1).
    wrapped = encode(
        struct.pack("<2H", 0x0000, 0xFFFF), 2, base=struct.pack("<2H", 0xFFFF, 0x0000), base_digest=BASE_DIGEST
    )
    assert decompress(split_frames(wrapped, 1)[0]) == bytes.fromhex("02010000")


def test_golden_xor_payload_still_decodes() -> None:
    """Kind 2, the XOR delta earlier stores hold."""
    base = struct.pack("<8H", 0x3F80, 0xC000, 0x3F00, 0x4040, 0x0000, 0x8000, 0x3FC0, 0x3F80)
    data = encode(BF16, 2, base=base, base_digest=BASE_DIGEST, delta="xor", block_bytes=8)
    assert data[:56] == b"CKE1" + bytes([2, 2, 0, 0]) + struct.pack("<IQ", 8, 16) + b"\xab" * 32 + struct.pack("<I", 2)
    frames = split_frames(data, 2)
    # Only the last element differs, in its sign bit: its high byte's group holds 0x80.
    decompress = zstandard.ZstdDecompressor().decompress
    assert [decompress(frame) for frame in frames] == [bytes(8), bytes(7) + b"\x80"]
    assert decode(data, nbytes=16, width=2, base=base) == BF16


def test_golden_payload_built_by_hand_decodes() -> None:
    """A payload of fixed bytes, frames and all (raw zstd blocks), decodes to the eight values."""
    fixed = (
        b"CKE1\x01\x02\x00\x00" + b"\x08\x00\x00\x00" + b"\x10" + bytes(7) + bytes(32) + b"\x02\x00\x00\x00"
        b"\x15\x00\x00\x00\x15\x00\x00\x00"
        # each frame: zstd magic, header (no single segment, 128 KiB window, 4-byte content
        # size 8), one last raw block of 8 bytes (header 0x41), then the block's grouped bytes
        + b"\x28\xb5\x2f\xfd\x80\x38\x08\x00\x00\x00\x41\x00\x00"
        + GROUPED_BLOCKS[0]
        + b"\x28\xb5\x2f\xfd\x80\x38\x08\x00\x00\x00\x41\x00\x00"
        + GROUPED_BLOCKS[1]
    )
    assert fixed == payload([zframe(8, zraw(block)) for block in GROUPED_BLOCKS])
    assert decode(fixed, nbytes=16, width=2) == BF16
    # The same blocks as a delta against zeros decode to the same bytes.
    delta = payload([zframe(8, zraw(block)) for block in GROUPED_BLOCKS], kind=DELTA, base=b"\xab" * 32)
    assert parse_head(delta, nbytes=16, width=2, subject=SUBJECT).base == BASE_DIGEST
    assert decode(delta, nbytes=16, width=2, base=bytes(16)) == BF16


# -- hostile payloads ------------------------------------------------------------------------

GOOD = [zframe(8, zraw(block)) for block in GROUPED_BLOCKS]

HOSTILE_HEADERS = {
    "shorter than the header": (payload(GOOD)[:55], "shorter than its header"),
    "empty": (b"", "shorter than its header"),
    "wrong magic": (payload(GOOD, magic=b"CKE2"), "not an encoded payload"),
    "safetensors bytes": (struct.pack("<Q", 2) + b"{}" + bytes(60), "not an encoded payload"),
    "unknown kind 0": (payload(GOOD, kind=0), "kind 0"),
    "unknown kind 4": (payload(GOOD, kind=4), "kind 4"),
    "group width of another dtype": (payload(GOOD, width=4), "groups of 4"),
    "group width 0": (payload(GOOD, width=0), "groups of 0"),
    "raw size too small": (payload(GOOD, nbytes=8), "describes 8 bytes"),
    "raw size too large": (payload(GOOD, nbytes=2**64 - 1), "describes 18446744073709551615 bytes"),
    "one block too many": (payload([*GOOD, GOOD[1]]), "3 blocks of 8 bytes"),
    "one block too few": (payload(GOOD[:1]), "1 blocks of 8 bytes"),
    "no blocks": (payload([]), "0 blocks of 8 bytes"),
    "block bytes 0": (payload(GOOD, block_bytes=0), "blocks of 0 bytes"),
    "block bytes not a multiple of 8": (payload(GOOD, block_bytes=12, count=2), "blocks of 12 bytes"),
    "block count far past the frame table": (payload(GOOD, count=2**32 - 1), "4294967295 blocks"),
    "frame table cut short": (payload(GOOD)[: HEAD.size + 6], "ends inside its frame table"),
    "a delta without base digest": (payload(GOOD, kind=DELTA), "base digest does not fit its encoding"),
    "a difference without base digest": (payload(GOOD, kind=DIFFERENCE), "base digest does not fit its encoding"),
    "a keyframe with a base digest": (payload(GOOD, base=b"\x01" * 32), "base digest does not fit its encoding"),
}


@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_hostile_headers(case: str) -> None:
    data, fragment = HOSTILE_HEADERS[case]
    with pytest.raises(IntegrityError) as caught:
        parse_head(data, nbytes=16, width=2, subject=SUBJECT)
    message = str(caught.value)
    assert message.startswith(SUBJECT + ": ") and fragment in message and "\n" not in message


BOMB = zframe(8, *[zrle(0, 1 << 17, last=index == 7) for index in range(8)])  # 42 bytes, 1 MiB out

HOSTILE_FRAMES = {
    "frames longer than the payload": (payload(GOOD, lengths=[21, 22]), "payload ends inside block 1"),
    "frame table pointing past a cut payload": (payload(GOOD)[:-1], "payload ends inside block 1"),
    "an empty frame": (payload([GOOD[0], b""]), "block 1 does not decompress"),
    "content size claims more": (payload([GOOD[0], zframe(16, zraw(bytes(16)))]), "claims 16 bytes, not 8"),
    "content size claims fewer": (payload([GOOD[0], zframe(4, zraw(bytes(4)))]), "claims 4 bytes, not 8"),
    "content size claims 0": (payload([GOOD[0], zframe(0, zraw(b""))]), "claims 0 bytes, not 8"),
    "frame without content size": (payload([GOOD[0], zframe(None, zraw(bytes(8)))]), "block 1 claims"),
    "claims its block but holds less": (payload([GOOD[0], zframe(8, zraw(bytes(4)))]), "block 1 does not decompress"),
    "claims its block but holds more": (payload([GOOD[0], zframe(8, zraw(bytes(9)))]), "block 1 does not decompress"),
    "decompression bomb": (payload([GOOD[0], BOMB]), "block 1 does not decompress"),
    "garbage frame": (payload([GOOD[0], b"not a zstd frame at all"]), "block 1 does not decompress"),
    "bytes after the frame": (payload([GOOD[0], GOOD[1] + b"\x00\x00"]), "block 1 does not decompress"),
    "two frames in one": (payload([GOOD[0], GOOD[1] + GOOD[1]]), "block 1 does not decompress"),
    "a skippable frame": (payload([GOOD[0], struct.pack("<II", 0x184D2A50, 8) + bytes(8)]), "block 1"),
    "a frame cut short": (payload([GOOD[0], GOOD[1][:-1]]), "block 1 does not decompress"),
}


@pytest.mark.parametrize("case", HOSTILE_FRAMES)
def test_hostile_frames(case: str) -> None:
    """Each case spoils block 1; the header still parses, decoding fails, and nothing is written
    outside block 0's bytes (block 1 not at all: a block is written only once it is whole)."""
    data, fragment = HOSTILE_FRAMES[case]
    head = parse_head(data, nbytes=16, width=2, subject=SUBJECT)
    buffer, view = guarded(16)
    with pytest.raises(IntegrityError) as caught:
        decode_chain([(head, data)], view, subject=SUBJECT)
    message = str(caught.value)
    assert message.startswith(SUBJECT + ": ") and fragment in message and "\n" not in message
    assert bytes(buffer) == bytes([0xA5]) * GUARD + BF16[:8] + bytes([0xA5]) * (8 + GUARD)
    # Decoding block 1 alone, straight into a view of exactly its bytes, fails the same way.
    buffer, view = guarded(8)
    with pytest.raises(IntegrityError, match="block 1"):
        decode_block(head, data, 1, view, subject=SUBJECT)
    assert bytes(buffer) == bytes([0xA5]) * (8 + 2 * GUARD)
    # The thread's decompressor is none the worse for it.
    assert decode(payload(GOOD), nbytes=16, width=2) == BF16


def test_the_bomb_is_a_real_one() -> None:
    """The hostile frame above, without its claim of 8 bytes, really inflates to a mebibyte."""
    assert len(BOMB) < 64
    unclaimed = zframe(None, *[zrle(0, 1 << 17, last=index == 7) for index in range(8)])
    assert zstandard.ZstdDecompressor().decompressobj().decompress(unclaimed) == bytes(1 << 20)


def test_chains_that_do_not_fit_together() -> None:
    base = make("random", 64, 4, 1)
    keyframe = encode(base, 4, block_bytes=16)
    other_blocks = encode(base, 4, block_bytes=32)
    delta = encode(base, 4, base=base, base_digest=BASE_DIGEST, block_bytes=16)

    def link(data: bytes) -> tuple[PayloadHead, bytes]:
        return parse_head(data, nbytes=64, width=4, subject=SUBJECT), data

    for chain in (
        [link(keyframe), link(keyframe)],  # a keyframe is nobody's delta
        [link(encode(base, 4, base=base, base_digest=BASE_DIGEST, block_bytes=32)), link(keyframe)],
        [link(delta), link(other_blocks)],
    ):
        out = bytearray(64)
        with pytest.raises(IntegrityError, match="delta chain does not fit together"):
            decode_chain(chain, memoryview(out), subject=SUBJECT)
        assert not any(out)
    shorter = encode(base[:32], 4, block_bytes=16)
    chain = [link(delta), (parse_head(shorter, nbytes=32, width=4, subject=SUBJECT), shorter)]
    with pytest.raises(IntegrityError, match="does not fit together"):
        decode_chain(chain, memoryview(bytearray(64)), subject=SUBJECT)
    with pytest.raises(ValueError, match="empty chain"):
        decode_chain([], memoryview(bytearray(64)), subject=SUBJECT)


# -- random damage ---------------------------------------------------------------------------

SAMPLE = make("floats", 200, 4, 11)
VALID = {
    "keyframe": encode(SAMPLE, 4, block_bytes=64),
    "xor delta": encode(SAMPLE, 4, base=perturb(SAMPLE, 4, 5), base_digest=BASE_DIGEST, delta="xor", block_bytes=64),
    "difference": encode(SAMPLE, 4, base=stepped(SAMPLE, 4, 5, 3), base_digest=BASE_DIGEST, block_bytes=64),
}


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(VALID)),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4),
    st.one_of(st.none(), st.integers(0, 10_000)),
    st.binary(max_size=8),
)
def test_damaged_payloads_fail_cleanly(kind: str, flips: list[tuple[int, int]], cut: int | None, tail: bytes) -> None:
    """Flipped bytes, a cut and bytes appended: an IntegrityError or some 200 bytes, nothing else,
    and never a write outside the tensor's bytes."""
    damaged = bytearray(VALID[kind])
    for position, mask in flips:
        damaged[position % len(damaged)] ^= mask
    if cut is not None:
        del damaged[cut % (len(damaged) + 1) :]
    damaged += tail
    buffer, view = guarded(200)
    try:
        head = parse_head(damaged, nbytes=200, width=4, subject=SUBJECT)
        decode_chain([(head, damaged)], view, subject=SUBJECT)
    except IntegrityError as exc:
        assert str(exc).startswith(SUBJECT + ": ")
    assert buffer[:GUARD] == buffer[-GUARD:] == bytes([0xA5]) * GUARD


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(WIDTHS), st.integers(0, 64))
def test_arbitrary_bytes_fail_cleanly(data: bytes, width: int, elements: int) -> None:
    nbytes = elements * width
    try:
        decode(data, nbytes=nbytes, width=width)
    except IntegrityError:
        pass
