"""Reading located tensors whatever their encoding: raw, a payload, or a delta chain down to a
raw or encoded base, over shards held in memory, and every way the records can mislead; whole
(``read_tensor``) and streamed a block at a time (``iter_decoded``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.service.errors import IntegrityError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.dtypes import byte_length, itemsize
from ckptstore.service.format.encoded_reads import (
    MAX_CHAIN,
    chain_of,
    decode_into,
    fetch_chain,
    iter_decoded,
    most_payload_bytes,
    read_tensor,
)
from ckptstore.service.format.encoding import BLOCK_BYTES, encode, head_bytes
from ckptstore.service.format.records import TensorLocation


class Shards:
    """Shards as bytes in a dict; ``read`` copies exactly the range asked for and logs it."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {}
        self.reads: list[tuple[str, int, int]] = []

    def put(self, stored: bytes, shard: int = 0) -> tuple[str, int]:
        """Append ``stored`` to shard ``shard`` (after a few bytes of something else); its id and offset."""
        shard_id = f"{shard + 1:064x}"
        body = self.data.setdefault(shard_id, bytearray(b"shard header"))
        body += b"\xee" * 5
        offset = len(body)
        body += stored
        return shard_id, offset

    def read(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        body = self.data[shard_id]
        if not 0 <= offset <= offset + buffer.nbytes <= len(body):
            raise AssertionError(f"read of {buffer.nbytes} bytes at {offset} is outside shard of {len(body)}")
        self.reads.append((shard_id, offset, buffer.nbytes))
        buffer[:] = body[offset : offset + buffer.nbytes]

    def keep_raw(self, dtype: str, shape: list[int], data: bytes, shard: int = 0) -> TensorLocation:
        shard_id, offset = self.put(data, shard)
        return TensorLocation(tensor_digest(dtype, shape, data), shard_id, offset, len(data), dtype, shape)

    def keep_encoded(
        self,
        dtype: str,
        shape: list[int],
        data: bytes,
        *,
        base: TensorLocation | None = None,
        base_data: bytes = b"",
        delta: Literal["diff", "xor"] = "diff",
    ) -> TensorLocation:
        """``data`` as a keyframe, or with ``base`` a delta (``delta``: a difference, or an XOR as
        earlier stores hold) against ``base_data`` (the base's bytes)."""
        digest = None if base is None else base.digest
        payload = encode(
            data, itemsize(dtype), base=None if base is None else base_data, base_digest=digest, delta=delta
        )
        shard_id, offset = self.put(payload, shard=1)
        encoding = "grouped-zstd" if base is None else f"{delta}-grouped-zstd"
        return TensorLocation(
            digest=tensor_digest(dtype, shape, data),
            shard_id=shard_id,
            offset=offset,
            nbytes=len(data),
            dtype=dtype,
            shape=shape,
            encoding=encoding,
            stored_nbytes=len(payload),
            base=digest,
        )


def versions(dtype: str, shape: list[int], count: int, seed: int = 0) -> list[bytes]:
    """``count`` versions of a tensor of small floats, each a few elements off the one before."""
    rng = np.random.default_rng(seed)
    width = itemsize(dtype)
    first = (rng.standard_normal(byte_length(dtype, shape) // 4) * 0.02).astype(np.float32).tobytes()
    found = [first]
    for _ in range(count - 1):
        changed = bytearray(found[-1])
        for index in rng.integers(0, len(changed) // width, 3):
            changed[index * width : (index + 1) * width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
        found.append(bytes(changed))
    return found


def chain(
    shards: Shards, dtype: str, shape: list[int], depth: int, bottom: str, seed: int = 0, deltas: str = "diff"
) -> tuple[dict[str, TensorLocation], list[bytes]]:
    """Versions stored as a chain ``depth`` payloads deep: a keyframe then deltas, or deltas
    above a raw tensor. The last version is the top, decoding through all of them. ``deltas``:
    "diff", "xor" (as earlier stores hold), or "mixed" (the two in turn)."""
    data = versions(dtype, shape, depth + 1 if bottom == "raw" else depth, seed)
    if bottom == "raw":
        located = [shards.keep_raw(dtype, shape, data[0])]
    else:
        located = [shards.keep_encoded(dtype, shape, data[0])]
    for number, (older, newer) in enumerate(zip(data, data[1:], strict=False)):
        delta: Literal["diff", "xor"] = "xor" if deltas == "xor" or (deltas == "mixed" and number % 2) else "diff"
        located.append(shards.keep_encoded(dtype, shape, newer, base=located[-1], base_data=older, delta=delta))
    return {location.digest: location for location in located}, data


def streamed(shards: Shards, locations: dict[str, TensorLocation], digest: str, piece_bytes: int = 1000) -> bytes:
    """``digest``'s bytes as :func:`iter_decoded` streams them, each piece checked for size."""
    pieces = list(iter_decoded(shards.read, locations, digest, piece_bytes))
    assert all(0 < len(piece) <= piece_bytes for piece in pieces)
    return b"".join(pieces)


def refused(shards: Shards, locations: dict[str, TensorLocation], digest: str, *fragments: str) -> str:
    """Read ``digest`` whole and, stored encoded, streamed: each must fail with an IntegrityError
    naming the tensor and ``fragments``."""
    readers = [read_tensor, streamed] if locations[digest].encoded else [read_tensor]
    for reader in readers:
        with pytest.raises(IntegrityError) as caught:
            reader(shards.read if reader is read_tensor else shards, locations, digest)  # type: ignore[arg-type]
        message = str(caught.value)
        assert "\n" not in message and "tensor " in message
        for fragment in fragments:
            assert fragment in message
    return message


# -- reads that work -------------------------------------------------------------------------


def test_a_raw_tensor_reads_as_its_bytes() -> None:
    shards = Shards()
    data = versions("F32", [64], 1)[0]
    location = shards.keep_raw("F32", [64], data)
    assert read_tensor(shards.read, {location.digest: location}, location.digest) == data
    assert shards.reads == [(location.shard_id, location.offset, 256)]


@pytest.mark.parametrize("bottom", ["raw", "keyframe"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("deltas", ["diff", "xor", "mixed"])
def test_chains_read_back_exactly(bottom: str, depth: int, deltas: str) -> None:
    shards = Shards()
    locations, data = chain(shards, "BF16", [40, 50], depth, bottom, deltas=deltas)
    top = tensor_digest("BF16", [40, 50], data[-1])
    assert len(chain_of(locations, top)) == (depth + 1 if bottom == "raw" else depth)
    assert read_tensor(shards.read, locations, top) == data[-1] == streamed(shards, locations, top)
    # Every version below the top reads back too, through the rest of the chain.
    for version in data:
        digest = tensor_digest("BF16", [40, 50], version)
        assert read_tensor(shards.read, locations, digest) == version
        assert not locations[digest].encoded or streamed(shards, locations, digest, 333) == version


@pytest.mark.parametrize("dtype", ["U8", "F16", "F32", "F64"])
def test_every_width_reads_back(dtype: str) -> None:
    shards = Shards()
    shape = [3, 40 // itemsize(dtype)]
    locations, data = chain(shards, dtype, shape, 2, "keyframe", seed=3)
    assert read_tensor(shards.read, locations, tensor_digest(dtype, shape, data[-1])) == data[-1]


@pytest.mark.parametrize("bottom", ["raw", "keyframe"])
def test_a_streamed_tensor_is_read_a_block_at_a_time(bottom: str) -> None:
    """Two and a half blocks, a delta on its base: no read is longer than a block's frame, where a
    whole read reads each payload at once."""
    shards = Shards()
    shape = [BLOCK_BYTES * 5 // 8]  # 2.5 MiB of float32
    locations, data = chain(shards, "F32", shape, 2 if bottom == "keyframe" else 1, bottom)
    top = tensor_digest("F32", shape, data[-1])
    longest = max(location.length for location in locations.values())
    assert longest > BLOCK_BYTES * 1.2

    assert streamed(shards, locations, top, BLOCK_BYTES // 3) == data[-1]
    assert max(length for _, _, length in shards.reads) <= most_payload_bytes(BLOCK_BYTES)
    shards.reads.clear()
    assert read_tensor(shards.read, locations, top) == data[-1]
    assert max(length for _, _, length in shards.reads) >= min(longest, BLOCK_BYTES * 2)


def test_a_frame_longer_than_its_block_can_be_is_refused_before_it_is_read() -> None:
    shards = Shards()
    shape = [BLOCK_BYTES * 5 // 8]
    locations, data = chain(shards, "F32", shape, 1, "keyframe")
    digest = tensor_digest("F32", shape, data[0])
    location = locations[digest]
    table = location.offset + head_bytes(0)
    body = shards.data[location.shard_id]
    lengths = np.frombuffer(bytes(body[table : table + 12]), dtype="<u4").copy()
    # The same payload length, all but two bytes of it claimed by the first frame.
    body[table : table + 12] = np.array([lengths.sum() - 2, 1, 1], dtype="<u4").tobytes()
    with pytest.raises(IntegrityError, match=f"{digest[:16]}.*block 0's frame of {lengths.sum() - 2} bytes"):
        streamed(shards, locations, digest)
    assert max(length for _, _, length in shards.reads) <= head_bytes(3)


def test_a_chain_of_max_chain_deltas_is_followed() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [16], MAX_CHAIN, "raw")
    assert read_tensor(shards.read, locations, tensor_digest("F32", [16], data[-1])) == data[-1]


def test_blocks_of_a_delta_over_a_raw_base_read_only_their_range() -> None:
    """Two and a half blocks: block 1 alone reads block 1 of the raw base and nothing else of it,
    and writes only block 1's bytes."""
    shards = Shards()
    shape = [BLOCK_BYTES * 5 // 4]  # 2.5 MiB of bfloat16
    locations, data = chain(shards, "BF16", shape, 1, "raw")
    top = tensor_digest("BF16", shape, data[-1])
    fetched = fetch_chain(shards.read, locations, top)
    assert fetched.blocks == 3 and fetched.raw_base is not None and len(fetched.links) == 1
    shards.reads.clear()
    out = bytearray(len(data[-1]))
    decode_into(shards.read, fetched, memoryview(out), blocks=range(1, 2))
    base = fetched.raw_base
    assert shards.reads == [(base.shard_id, base.offset + BLOCK_BYTES, BLOCK_BYTES)]
    assert out[BLOCK_BYTES : 2 * BLOCK_BYTES] == data[-1][BLOCK_BYTES : 2 * BLOCK_BYTES]
    assert not any(out[:BLOCK_BYTES]) and not any(out[2 * BLOCK_BYTES :])
    shards.reads.clear()
    decode_into(shards.read, fetched, memoryview(out), blocks=range(0))
    assert shards.reads == []
    assert read_tensor(shards.read, locations, top) == data[-1]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20_000), st.integers(0, 2**32 - 1))
def test_the_longest_payloads_fit_the_bound(nbytes: int, seed: int) -> None:
    """Incompressible bytes, whole and as a delta: the largest payloads there are."""
    rng = np.random.default_rng(seed)
    data, base = rng.bytes(nbytes), rng.bytes(nbytes)
    assert len(encode(data, 1)) <= most_payload_bytes(nbytes)
    assert len(encode(data, 1, base=base, base_digest="00" * 31 + "01")) <= most_payload_bytes(nbytes)


def test_the_longest_payloads_of_several_blocks_fit_the_bound() -> None:
    data = np.random.default_rng(5).bytes(2 * BLOCK_BYTES + 8)
    assert len(encode(data, 8)) <= most_payload_bytes(len(data))


# -- records that mislead --------------------------------------------------------------------


def test_a_missing_base_is_refused() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 2, "keyframe")
    del locations[tensor_digest("F32", [32], data[0])]
    top = tensor_digest("F32", [32], data[1])
    refused(shards, locations, top, "its delta base", tensor_digest("F32", [32], data[0]), "was not located")


def test_a_loop_is_refused_before_anything_is_read() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 3, "keyframe")
    bottom, middle, top = (tensor_digest("F32", [32], version) for version in data)
    # The bottom claims the top as its base: top -> middle -> bottom -> top.
    looped = {**locations, bottom: dataclasses.replace(locations[bottom], base=top)}
    refused(shards, looped, top, top[:16], "loops or is deeper than 16")
    itself = {middle: dataclasses.replace(locations[middle], base=middle)}
    refused(shards, itself, middle, "loops")
    assert shards.reads == []


def test_a_chain_deeper_than_max_chain_is_refused() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [16], MAX_CHAIN + 1, "raw")
    top = tensor_digest("F32", [16], data[-1])
    refused(shards, locations, top, f"deeper than {MAX_CHAIN}")
    assert shards.reads == []


@pytest.mark.parametrize(("dtype", "shape"), [("I32", [32]), ("F32", [16]), ("F32", [33])])
def test_a_base_of_another_dtype_or_size_is_refused(dtype: str, shape: list[int]) -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 2, "raw")
    base_digest = tensor_digest("F32", [32], data[0])
    impostor = shards.keep_raw(dtype, shape, versions(dtype, shape, 1, seed=9)[0])
    locations[base_digest] = dataclasses.replace(impostor, digest=base_digest)
    top = tensor_digest("F32", [32], data[-1])
    refused(shards, locations, top, "its delta base", base_digest[:16], "has another dtype or size")


def test_a_base_of_another_shape_but_the_same_bytes_is_read() -> None:
    """A delta applies to bytes: its base may be a reshaped tensor of the same dtype and length."""
    shards = Shards()
    old, new = versions("F32", [4, 8], 2)
    base = shards.keep_raw("F32", [32], old)
    top = shards.keep_encoded("F32", [4, 8], new, base=base, base_data=old)
    assert read_tensor(shards.read, {base.digest: base, top.digest: top}, top.digest) == new


@pytest.mark.parametrize("stored", ["zero", "above the bound"])
def test_a_payload_longer_than_any_is_refused_before_it_is_read(stored: str) -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 1, "keyframe")
    digest = tensor_digest("F32", [32], data[0])
    length = 0 if stored == "zero" else most_payload_bytes(128) + 1
    locations[digest] = dataclasses.replace(locations[digest], stored_nbytes=length)
    refused(shards, locations, digest, digest[:16], f"a {length}-byte payload cannot hold 128 bytes")
    assert shards.reads == []


@pytest.mark.parametrize("change", [-1, +1, +7])
def test_a_stored_length_other_than_the_payloads_is_refused(change: int) -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 2, "keyframe")
    shards.data[locations[tensor_digest("F32", [32], data[1])].shard_id] += bytes(16)  # room to read past
    for version in data:
        digest = tensor_digest("F32", [32], version)
        location = locations[digest]
        wrong = {**locations, digest: dataclasses.replace(location, stored_nbytes=location.length + change)}
        refused(shards, wrong, tensor_digest("F32", [32], data[1]), "does not match what the store records")


def test_a_recorded_base_other_than_the_payloads_is_refused() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 2, "raw")
    top = tensor_digest("F32", [32], data[-1])
    middle = tensor_digest("F32", [32], data[1])
    # The top's record names the raw bottom as its base, skipping the delta its payload was made against.
    skipping = {**locations, top: dataclasses.replace(locations[top], base=tensor_digest("F32", [32], data[0]))}
    refused(shards, skipping, top, top[:16], "does not match what the store records")
    # A keyframe recorded as a delta.
    keyframe = shards.keep_encoded("F32", [32], data[1])
    as_delta = {**locations, middle: dataclasses.replace(keyframe, base=tensor_digest("F32", [32], data[0]))}
    refused(shards, as_delta, middle, "does not match what the store records")


def test_a_payload_of_another_dtype_is_refused() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 1, "keyframe")
    digest = tensor_digest("F32", [32], data[0])
    locations[digest] = dataclasses.replace(locations[digest], dtype="F16", shape=[64])
    refused(shards, locations, digest, "groups of 4", "2-byte elements")


@pytest.mark.parametrize("bottom", ["raw", "keyframe"])
def test_bytes_that_do_not_hash_to_the_digest_are_refused(bottom: str) -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [32], 1, bottom)
    top = tensor_digest("F32", [32], data[-1])
    # The record of another tensor's bytes filed under this digest.
    other = shards.keep_encoded("F32", [32], versions("F32", [32], 1, seed=4)[0])
    filed = {**locations, top: dataclasses.replace(other, digest=top)}
    refused(shards, filed, top, top[:16], "reads back as", "ckptstore verify")
    # A raw base whose bytes changed in the shard: the delta above it decodes, to the wrong bytes.
    if bottom == "raw":
        base = locations[tensor_digest("F32", [32], data[0])]
        shards.data[base.shard_id][base.offset] ^= 0x01
        refused(shards, locations, top, top[:16], "reads back as")
        refused(shards, locations, base.digest, base.digest[:16], "reads back as")


def test_a_corrupt_payload_in_the_shard_is_refused() -> None:
    shards = Shards()
    locations, data = chain(shards, "F32", [256], 2, "keyframe")
    bottom = locations[tensor_digest("F32", [256], data[0])]
    shards.data[bottom.shard_id][bottom.offset + bottom.length - 3] ^= 0xFF  # inside its one frame
    top = tensor_digest("F32", [256], data[-1])
    # zstd may find the damage (block 0 does not decompress) or decode other bytes (the digest).
    refused(shards, locations, top, top[:16])
