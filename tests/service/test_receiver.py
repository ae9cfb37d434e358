"""ShardReceiver and Store.put_shard: one pass over the bytes, header checked first, nothing left on failure."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.errors import IntegrityError, InvalidInputError, InvalidShardError, PayloadTooLargeError
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES, encode_header
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.store import Store
from tests.format.test_safetensors_header import HOSTILE
from tests.service.shardkit import BuiltShard, build_shard, raw

TENSORS = [raw("F32", [64, 33], 1), raw("BF16", [7], 2), raw("U8", [1000], 3)]
SHARD = build_shard(TENSORS)


def feed(receiver: ShardReceiver, data: bytes, cuts: list[int]) -> None:
    """Give ``data`` to the receiver split at ``cuts``."""
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
    for start, end in zip(edges, edges[1:], strict=False):
        receiver.write(memoryview(data)[start:end])


def staged(home: Path) -> list[Path]:
    """Files left in the store's staging folder."""
    return sorted((home / "staging").iterdir())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(SHARD.data)), max_size=12))
def test_any_split_of_the_bytes_gives_the_same_verified_file(tmp_path: Path, cuts: list[int]) -> None:
    path = tmp_path / "shard.incomplete"
    receiver = ShardReceiver(path, expected_id=SHARD.shard_id)
    feed(receiver, SHARD.data, cuts)
    header = receiver.finish()
    assert header.shard_id == SHARD.shard_id
    assert [e.digest for e in header.entries] == [t.digest for t in TENSORS]
    assert path.read_bytes() == SHARD.data
    receiver.discard()
    assert not path.exists()


def test_a_wrong_id_is_refused_as_soon_as_the_header_is_complete(tmp_path: Path) -> None:
    receiver = ShardReceiver(tmp_path / "s", expected_id="0" * 64)
    receiver.write(SHARD.data[:8])
    with pytest.raises(IntegrityError, match="as the URL says"):
        receiver.write(SHARD.data[8 : SHARD.header_length])
    assert not (tmp_path / "s").exists()  # no data byte was written anywhere


@pytest.mark.parametrize("index", range(len(TENSORS)))
def test_a_flipped_byte_in_a_tensor_given_whole_is_caught(tmp_path: Path, index: int) -> None:
    # One write() per whole tensor, as an embedded save gives them: each is hashed in one call.
    pieces = [bytearray(t.data) for t in TENSORS]
    pieces[index][-1] ^= 0x01
    receiver = ShardReceiver(tmp_path / "s", expected_id=SHARD.shard_id)
    receiver.write(SHARD.data[: SHARD.header_length])
    with pytest.raises(IntegrityError, match=f"shard tensor {TENSORS[index].digest[:16]}"):
        for piece in pieces:
            receiver.write(piece)
    receiver.discard()
    assert not (tmp_path / "s").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(min_value=0, max_value=len(SHARD.data) - SHARD.header_length), max_size=5),
    whole_from=st.integers(0, len(TENSORS)),
    flip=st.one_of(st.none(), st.integers(0, len(TENSORS) - 1)),
)
def test_tensors_given_together_are_taken_as_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, cuts: list[int], whole_from: int, flip: int | None
) -> None:
    """``write_tensors`` after the header (what an embedded save does) takes whole tensors, and
    any pieces that are not whole tensors, exactly as ``write`` does: the same file, the same
    bytes counted, a changed byte refused."""
    path = tmp_path_factory.mktemp("receiver") / "shard"
    datas = [bytearray(t.data) for t in TENSORS]
    if flip is not None:
        datas[flip][0] ^= 0x01
    body = b"".join(datas)
    start = sum(len(d) for d in datas[:whole_from])
    edges = [start, *sorted({start + c for c in cuts if 0 < c < len(body) - start}), len(body)]
    pieces = [memoryview(d) for d in datas[:whole_from]]
    pieces += [memoryview(body)[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]
    counted: list[int] = []
    receiver = ShardReceiver(path, expected_id=SHARD.shard_id)
    receiver.write(SHARD.data[: SHARD.header_length])
    if flip is not None:
        with pytest.raises(IntegrityError, match=f"shard tensor {TENSORS[flip].digest[:16]}"):
            receiver.write_tensors(pieces, counted.append)
        receiver.discard()
        assert not path.exists()
        return
    receiver.write_tensors(pieces, counted.append)
    assert receiver.finish().shard_id == SHARD.shard_id
    assert path.read_bytes() == SHARD.data and sum(counted) == len(body)
    receiver.discard()


@pytest.mark.parametrize(
    "position", [0, 1, 64 * 33 * 4 - 1, 64 * 33 * 4 + 3, len(SHARD.data) - SHARD.header_length - 1]
)
def test_a_flipped_data_byte_is_caught_while_streaming(tmp_path: Path, position: int) -> None:
    data = bytearray(SHARD.data)
    data[SHARD.header_length + position] ^= 0x01
    receiver = ShardReceiver(tmp_path / "s", expected_id=SHARD.shard_id)
    with pytest.raises(IntegrityError, match="hashes to"):
        feed(receiver, bytes(data), list(range(0, len(data), 977)))
        receiver.finish()
    receiver.discard()
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"", InvalidInputError, "empty"),
        (SHARD.data[:5], InvalidShardError, "at least 8"),
        (SHARD.data[: SHARD.header_length - 3], InvalidShardError, "inside its header"),
        (SHARD.data[:-1], InvalidShardError, "too few"),
        (struct.pack("<Q", 1 << 40) + b"{}", InvalidShardError, "the limit is"),
        (struct.pack("<Q", 1) + b"{", InvalidShardError, "at least 2"),
    ],
)
def test_incomplete_or_malformed_uploads_are_refused(
    tmp_path: Path, data: bytes, error: type[Exception], message: str
) -> None:
    receiver = ShardReceiver(tmp_path / "s")
    with pytest.raises(error, match=message):
        receiver.write(data)
        receiver.finish()
    receiver.discard()
    assert not (tmp_path / "s").exists()


def test_trailing_bytes_are_refused(tmp_path: Path) -> None:
    receiver = ShardReceiver(tmp_path / "s")
    with pytest.raises(InvalidShardError, match="trailing"):
        receiver.write(SHARD.data + b"PK\x03\x04")


def test_the_size_limit_is_enforced_from_the_header_before_the_data(tmp_path: Path) -> None:
    receiver = ShardReceiver(tmp_path / "s", max_bytes=SHARD.header_length + 10)
    with pytest.raises(PayloadTooLargeError, match="exceeds the limit"):
        receiver.write(SHARD.data[: SHARD.header_length])


def test_a_header_listing_an_empty_tensor_is_refused_before_any_data(tmp_path: Path) -> None:
    empty = raw("F32", [0], 9)
    header, _ = encode_header([(TENSORS[2].digest, "U8", [1000]), (empty.digest, "F32", [0])])
    receiver = ShardReceiver(tmp_path / "s")
    with pytest.raises(InvalidShardError, match="empty"):
        receiver.write(header)
    assert not (tmp_path / "s").exists()


def shard_pieces(shard: BuiltShard) -> tuple[bytes, list[memoryview]]:
    """A built shard as put_shard takes it: header bytes and one view per tensor."""
    views = [memoryview(t.data) for t in TENSORS]
    return shard.data[: shard.header_length], views


def test_put_shard_stores_a_shard_that_reads_back_and_is_idempotent(store: Store, home: Path) -> None:
    header, pieces = shard_pieces(SHARD)
    seen: list[int] = []
    receipt = store.put_shard(header, pieces, seen.append)
    assert (receipt.shard_id, receipt.size, receipt.tensors, receipt.created) == (
        SHARD.shard_id,
        len(SHARD.data),
        3,
        True,
    )
    assert seen == [len(t.data) for t in TENSORS]
    assert store.missing([t.digest for t in TENSORS]) == []
    buffer = bytearray(len(SHARD.data))
    store.read_into(SHARD.shard_id, 0, memoryview(buffer))
    assert bytes(buffer) == SHARD.data
    assert store.put_shard(header, pieces).created is False
    assert staged(home) == []


def test_put_shard_with_bytes_that_changed_after_hashing_stores_nothing(store: Store, home: Path) -> None:
    header, pieces = shard_pieces(SHARD)
    changed = bytearray(TENSORS[0].data)
    changed[100] ^= 0xFF  # a tensor written to after its digest was taken
    with pytest.raises(IntegrityError):
        store.put_shard(header, [memoryview(changed), *pieces[1:]])
    assert sorted(store.missing([t.digest for t in TENSORS])) == sorted(t.digest for t in TENSORS)
    assert staged(home) == []
    assert store.blobs.size(SHARD.shard_id) is None


@pytest.mark.parametrize(("data", "match", "header_rule"), HOSTILE)
def test_every_hostile_shard_is_refused_by_the_receiver_too(
    tmp_path: Path, data: bytes, match: str, header_rule: bool
) -> None:
    del header_rule  # a stream has no file size: the receiver applies every rule
    # The receiver takes the header's length and rules from the shard reader, so each hostile
    # file of the reader's corpus is refused here too, fed in small pieces as an upload arrives,
    # and nothing is left behind.
    path = tmp_path / "s"
    receiver = ShardReceiver(path)
    with pytest.raises(InvalidInputError) as info:
        for index in range(0, len(data), 7):
            receiver.write(data[index : index + 7])
        receiver.finish()
    receiver.discard()
    assert not path.exists()
    if not data:
        assert str(info.value) == "the shard upload is empty"
        return
    assert isinstance(info.value, InvalidShardError), info.value
    announced = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else None
    if announced is not None and announced <= MAX_HEADER_BYTES and 8 + announced > len(data):
        assert "ended inside its header" in str(info.value)  # the reader says the header "announces" more
    else:
        assert re.search(match, str(info.value)), info.value
